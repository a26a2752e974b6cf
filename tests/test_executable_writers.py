"""An Executable is changed only in its own module: no attribute store into one from elsewhere.

What an executable is known by (its cache key, the argument types it takes)
is given as it is made (worker/compile/executable.py: compile_executable,
deserialize_executable, TopologyExecutable); the loaders used to store them
into it afterwards, from several modules. This reads the source (ast) of
pool/ and worker/, not the running code. A name holds an Executable when it
is annotated as one, or bound (directly, by unpacking, by indexing, or by a
``with ... as``) from a call of a function whose return annotation names
Executable (or a tuple, union or context manager holding one), or from a
name that holds one. Outside executable.py, no such name may be the
receiver of an attribute store, an augmented store, a del or a setattr.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pool", "worker")
HOME = ROOT / "worker" / "compile" / "executable.py"
_EXECUTABLE = re.compile(r"\b(?:Topology)?Executable\b")


def _sources() -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def _names_executable(annotation: ast.AST | None) -> bool:
    return annotation is not None and bool(_EXECUTABLE.search(ast.unparse(annotation)))


def _producers(trees: list[ast.Module]) -> set[str]:
    """Names of the functions and methods annotated to return an Executable, and the classes."""
    found = {"Executable", "TopologyExecutable"}
    for tree in trees:
        for node in ast.walk(tree):
            is_function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if is_function and _names_executable(node.returns):
                found.add(node.name)
    return found


def _called(node: ast.AST) -> str | None:
    if not isinstance(node, ast.Call):
        return None
    if isinstance(node.func, ast.Name):
        return node.func.id
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    return None


def _in_scope(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a scope (a module or a function), without those of the functions in it
    (each is a scope of its own)."""
    for child in ast.iter_child_nodes(scope):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _in_scope(child)


def _target_names(target: ast.AST) -> list[str]:
    """The names an assignment target binds (not the receivers of attributes it stores)."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for element in target.elts for name in _target_names(element)]
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    return []


def _holders(scope: ast.AST, producers: set[str]) -> set[str]:
    """The names in a scope that may hold an Executable (see the module)."""
    holders: set[str] = set()
    for node in _in_scope(scope):
        if isinstance(node, ast.arg) and _names_executable(node.annotation):
            holders.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and _names_executable(node.annotation):
            holders.update(_target_names(node.target))
    changed = True
    while changed:  # until no binding adds a name (a name bound from a holder is one)
        size = len(holders)
        for node in _in_scope(scope):
            pairs: list[tuple[ast.AST, ast.AST | None]] = []
            if isinstance(node, ast.Assign):
                pairs = [(target, node.value) for target in node.targets]
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)):
                pairs = [(node.target, node.value)]
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                pairs = [(item.optional_vars, item.context_expr) for item in node.items]
            for target, value in pairs:
                if (
                    target is not None
                    and value is not None
                    and _produces(value, producers, holders)
                ):
                    holders.update(_target_names(target))
        changed = len(holders) != size
    return holders


def _produces(value: ast.AST, producers: set[str], holders: set[str]) -> bool:
    if _called(value) in producers:
        return True
    if isinstance(value, ast.Subscript):
        value = value.value
    if isinstance(value, ast.Name):
        return value.id in holders
    if isinstance(value, (ast.Tuple, ast.List)):
        return any(_produces(element, producers, holders) for element in value.elts)
    if isinstance(value, (ast.BoolOp, ast.IfExp)):
        parts = value.values if isinstance(value, ast.BoolOp) else [value.body, value.orelse]
        return any(_produces(part, producers, holders) for part in parts)
    return False


def _stores(tree: ast.Module, producers: set[str], where: str) -> list[str]:
    """Stores into a name that holds an Executable, in each function and at module level."""
    found: list[str] = []
    scopes = [tree] + [
        node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    for scope in scopes:
        holders = _holders(scope, producers)
        for node in _in_scope(scope):
            targets: list[ast.AST] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            elif _called(node) in ("setattr", "delattr") and node.args:  # type: ignore[attr-defined]
                targets = [ast.Attribute(value=node.args[0], attr="?")]  # type: ignore[attr-defined]
            for target in targets:
                for leaf in ast.walk(target):
                    if (
                        isinstance(leaf, ast.Attribute)
                        and isinstance(leaf.value, ast.Name)
                        and leaf.value.id in holders
                    ):
                        line = getattr(node, "lineno", "?")
                        found.append(f"{where}:{line}: stores {leaf.value.id}.{leaf.attr}")
    return found


def test_no_store_into_an_executable_outside_its_module():
    paths = list(_sources())
    trees = {path: ast.parse(path.read_text(), filename=str(path)) for path in paths}
    producers = _producers(list(trees.values()))
    assert {"compile_program", "load_cached_executable", "deserialize_executable"} <= producers
    found = []
    for path, tree in trees.items():
        if path != HOME:
            found += _stores(tree, producers, str(path.relative_to(ROOT)))
    assert found == [], "\n".join(found)


def test_the_walk_finds_the_stores_that_were_there():
    """The forms the loaders used before (main 7201f66): each is found."""
    source = """
def load_entry(cache, key) -> tuple[Executable, Entry] | Miss: ...

def _load(cache, key, program):
    loaded = load_entry(cache, key)
    executable = loaded[0]
    executable.input_types = program.input_types

def by_key(cache, key):
    loaded = load_entry(cache, key)
    executable, entry = loaded
    executable.input_types = None

def compiled(target, code, options, key):
    executable = target.compile(code, options)
    executable.key = key

def bundled(payload, key):
    executable = Executable.deserialize(payload)
    setattr(executable, "key", key)

def annotated(executable: Executable, key):
    executable.key = key

def fine(report, key):
    report.key = key
"""
    tree = ast.parse(source)
    producers = _producers([tree]) | {"compile", "deserialize"}  # methods defined elsewhere
    found = _stores(tree, producers, "x")
    assert [line.split(": ", 1)[1] for line in found] == [
        "stores executable.input_types",
        "stores executable.input_types",
        "stores executable.key",
        "stores executable.?",
        "stores executable.key",
    ]
