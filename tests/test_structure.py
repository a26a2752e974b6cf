"""The layout stays a map: records with one writer each, floors that only point down, no
import cycles, and package docstrings that name what is there.

The checks read the source (ast), not the running code:

- Every record the Pool's parts share (Task, WorkerProcess, Tasks, WorkerStarts) is
  changed only by its own class: no store to one of its attributes, no
  mutating call on one of its attributes' containers, and no use of its
  private attributes, from anywhere else in the executor (pool/executor,
  the only code that holds these records).
- No import cycle among the modules of pool/ and worker/, counting every
  import: at module level, inside functions, and under TYPE_CHECKING.
- The floors: worker/ and pool/ each state theirs in their __init__'s
  docstring (a line such as ``*.py < wire/ < cache/``, lowest first), and
  every module imports only from its own floor and those below; worker/
  imports nothing of pool/ and never JAX.
- No back-arrows between the parts of any package: of two modules or
  sub-packages side by side, at most one imports the other.
- Every package's __init__ docstring names exactly its modules (``name.py``)
  and sub-packages (``name/``), except the platform modules of
  worker/plugin/platforms: there each module that the docstring does not name
  is a platform (it defines PLATFORM, the platform of its own name), so that
  adding a platform is adding its module.
"""

from __future__ import annotations

import ast
import importlib
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pool", "worker")
EXECUTOR = "pool.executor"
NATIVE = ("worker._pjrt",)
"""Extension modules: imported like modules, with no source to read."""
PLATFORMS = "worker.plugin.platforms"
"""The package of one module per platform, which its docstring need not name one by one."""

OWNED = {
    "Task": "pool/executor/tasks.py",
    "Tasks": "pool/executor/tasks.py",
    "WorkerProcess": "pool/executor/worker_process.py",
    "WorkerStarts": "pool/executor/starts.py",
}
"""The records whose attributes only their own class may change, and where each is defined."""

_MUTATING = frozenset(
    {
        "add",
        "append",
        "appendleft",
        "clear",
        "discard",
        "extend",
        "extendleft",
        "insert",
        "move_to_end",
        "pop",
        "popitem",
        "popleft",
        "remove",
        "setdefault",
        "update",
    }
)


def _modules() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join(parts), path


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _attributes_of(tree: ast.Module, name: str) -> set[str]:
    """The attributes a class defines: class-level names (dataclass fields, slots) and every
    self.NAME it stores in its methods."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ClassDef) and node.name == name):
            continue
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                found.add(item.target.id)
            elif isinstance(item, ast.Assign):
                found.update(t.id for t in item.targets if isinstance(t, ast.Name))
        for inner in ast.walk(node):
            if isinstance(inner, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = inner.targets if isinstance(inner, ast.Assign) else [inner.target]
                for target in targets:
                    for leaf in ast.walk(target):
                        if (
                            isinstance(leaf, ast.Attribute)
                            and isinstance(leaf.value, ast.Name)
                            and leaf.value.id == "self"
                        ):
                            found.add(leaf.attr)
    return found - {"__slots__", "__hash__"}


def _owned_attributes() -> dict[str, set[str]]:
    return {name: _attributes_of(_parse(ROOT / path), name) for name, path in OWNED.items()}


class _Writes(ast.NodeVisitor):
    """Finds stores to, and mutating calls on, attributes named in `watched` whose receiver
    is not `self` (or that are private and read through another object), outside the
    classes that own them."""

    def __init__(self, module: str, watched: dict[str, set[str]]) -> None:
        self.module = module
        self.watched = watched
        self.classes: list[str] = []
        self.found: list[str] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()

    def _owners(self, attribute: str) -> list[str]:
        return [name for name, attributes in self.watched.items() if attribute in attributes]

    def _report(self, node: ast.AST, what: str, attribute: str) -> None:
        owners = self._owners(attribute)
        inside = self.classes[-1] if self.classes else None
        if owners and inside not in owners:
            where = f"{self.module}:{node.lineno}"  # type: ignore[attr-defined]
            self.found.append(f"{where}: {what} {attribute!r} of {'/'.join(owners)}")

    def _check_target(self, target: ast.AST, node: ast.AST) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self._check_target(element, node)
        elif isinstance(target, ast.Starred):
            self._check_target(target.value, node)
        elif isinstance(target, ast.Attribute) and not _is_self(target.value):
            self._report(node, "stores", target.attr)
        elif (
            isinstance(target, ast.Subscript)
            and isinstance(target.value, ast.Attribute)
            and not _is_self(target.value.value)
        ):
            self._report(node, "stores an item of", target.value.attr)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._check_target(target, node)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._check_target(node.target, node)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._check_target(node.target, node)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self._check_target(target, node)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        function = node.func
        if (
            isinstance(function, ast.Attribute)
            and function.attr in _MUTATING
            and isinstance(function.value, ast.Attribute)
            and not _is_self(function.value.value)
        ):
            self._report(node, f"calls {function.attr}() on", function.value.attr)
        if (
            isinstance(function, ast.Name)
            and function.id in ("setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
        ):
            self._report(node, f"{function.id}s", str(node.args[1].value))
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        private = node.attr.startswith("_") and not node.attr.startswith("__")
        if private and not _is_self(node.value) and not _is_module_like(node.value):
            self._report(node, "uses the private", node.attr)
        self.generic_visit(node)


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _is_module_like(node: ast.AST) -> bool:
    # A module's private name (os._exit, sys._getframe) is no record's.
    return isinstance(node, ast.Name) and node.id in ("os", "sys", "threading")


def test_the_records_of_the_pool_have_one_writer_each():
    watched = _owned_attributes()
    assert watched["Task"] and watched["WorkerProcess"] and watched["Tasks"]
    found = []
    for module, path in _modules():
        if not module.startswith(EXECUTOR):
            continue
        visitor = _Writes(module, watched)
        visitor.visit(_parse(path))
        found += visitor.found
    assert found == [], "\n".join(found)


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that a module imports anywhere in its source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges: set[str] = set()
    for node in ast.walk(_parse(path)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from package import name` imports the submodule when there is one.
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                edges.add(name)
    return edges


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph as a list of modules (its first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for successor in sorted(graph[node]):
            if state.get(successor) == 1:
                return [*stack[stack.index(successor) :], successor]
            if successor not in state:
                cycle = visit(successor)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_import_cycles_in_pool_and_worker():
    cycle = _cycle(_import_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


JAXLIB_MODULES = "worker.plugin.jaxlib"
"""The worker side imports jaxlib (JAX's compiled half, never jax itself) only in the modules
whose names start so: those that compile or run through jaxlib's own clients."""


def _imported_names(tree: ast.Module) -> Iterator[str]:
    """Every module name an absolute import anywhere in the tree names."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            yield node.module or ""


def _imports_jax(tree: ast.Module) -> list[str]:
    return [name for name in _imported_names(tree) if name.split(".")[0] in ("jax", "jaxlib")]


def test_the_worker_side_never_imports_jax():
    for module, path in _modules():
        if module.startswith("worker"):
            for name in _imports_jax(_parse(path)):
                jaxlib = name.split(".")[0] == "jaxlib"
                assert jaxlib and module.startswith(JAXLIB_MODULES), f"{module} imports {name}"


def test_the_executor_never_imports_jax():
    """The Pool's machinery runs warmed programs without JAX (a serving process's start): what
    it needs of JAX's state it reads where JAX is imported already (sys.modules)."""
    for module, path in _modules():
        if module.startswith(EXECUTOR):
            assert not _imports_jax(_parse(path)), f"{module} imports {_imports_jax(_parse(path))}"


def _import_graph() -> dict[str, set[str]]:
    modules = dict(_modules())
    known = set(modules) | set(NATIVE)
    graph = {module: _imports(module, path, known) for module, path in modules.items()}
    graph.update((name, set()) for name in NATIVE)
    return graph


def _packages() -> dict[str, Path]:
    """Every package of pool/ and worker/, by name, with its __init__.py."""
    return {module: path for module, path in _modules() if path.name == "__init__.py"}


_FLOORS = re.compile(r"^\s*([\w*./, ]+?(?:\s+<\s+[\w*./, ]+?)+)\s*$", re.MULTILINE)


def _stated_floors(package: str) -> list[set[str]]:
    """The floors a package's docstring states, lowest first, as sets of names ("*.py" is
    every module of the package's own that no floor names, "cache/" a sub-package, "log.py"
    a module)."""
    docstring = ast.get_docstring(_parse(ROOT / package / "__init__.py")) or ""
    lines = _FLOORS.findall(re.sub(r"<[ \t]*\n\s*", "< ", docstring))  # a line ending "<" goes on
    assert len(lines) == 1, f"{package}/__init__.py states no floors (a line 'a/ < b/ < c/')"
    return [{name.strip() for name in floor.split(",")} for floor in lines[0].split("<")]


def _floor_of(module: str, package: str, floors: list[set[str]]) -> int | None:
    """The floor (its index, lowest 0) of a module of `package`; None for the package's own
    face (its __init__ and __main__, above every floor); raises KeyError if none holds it."""
    part = module.removeprefix(package + ".").split(".")[0]
    if module == package or part == "__main__":
        return None
    names = {f"{part}/", f"{part}.py"} if part != "_pjrt" else {"_pjrt", "*.py"}
    for index, floor in enumerate(floors):
        if floor & names:
            return index
    if (ROOT / package / part).is_dir():
        raise KeyError(f"{package}/{part}/ is on no floor of {package}/__init__.py")
    for index, floor in enumerate(floors):
        if "*.py" in floor:
            return index
    raise KeyError(f"{package}/{part}.py is on no floor of {package}/__init__.py")


def test_the_floors_only_point_down():
    graph = _import_graph()
    found = []
    for package in PACKAGES:
        floors = _stated_floors(package)
        for module, imported in sorted(graph.items()):
            if not module.startswith(package):
                continue
            here = _floor_of(module, package, floors)
            for target in sorted(imported):
                if not target.startswith(package + ".") or here is None:
                    continue
                there = _floor_of(target, package, floors)
                if there is None or there > here:
                    found.append(f"{module} imports {target}, a floor above it")
    assert found == [], "\n".join(found)


def test_the_worker_side_imports_nothing_of_the_parent():
    found = [
        f"{module} imports {target}"
        for module, imported in _import_graph().items()
        if module.startswith("worker")
        for target in imported
        if target.split(".")[0] == "pool"
    ]
    assert found == []


def _part(module: str, package: str) -> str | None:
    """The module or sub-package directly in `package` that holds `module`, or None."""
    if not module.startswith(package + "."):
        return None
    return f"{package}.{module.removeprefix(package + '.').split('.')[0]}"


def test_no_back_arrows_between_the_parts_of_a_package():
    graph = _import_graph()
    for package in _packages():
        parts: dict[str, set[str]] = {}
        for module, imported in graph.items():
            here = _part(module, package)
            if here is None:
                continue
            parts.setdefault(here, set())
            for target in imported:
                there = _part(target, package)
                if there is not None and there != here:
                    parts[here].add(there)
                    parts.setdefault(there, set())
        cycle = _cycle(parts)
        assert cycle is None, f"in {package}: " + " -> ".join(cycle or [])


_MAP_NAME = re.compile(r"(?<![\w./*-])([A-Za-z_]\w*)(\.py\b|/(?=[\s,;:)]|$))")
_LITERAL = re.compile(r"``.*?``", re.DOTALL)


def _mapped(docstring: str) -> set[str]:
    """The modules (name.py) and sub-packages (name/) a package docstring names, and the
    extension modules it names by their bare names; ``literal text`` names none (a path of
    another folder: ``plugins/``)."""
    docstring = _LITERAL.sub("", docstring)
    named = {name + suffix for name, suffix in _MAP_NAME.findall(docstring)}
    native = {name.rpartition(".")[2] for name in NATIVE}
    return named | {word for word in re.findall(r"\b\w+\b", docstring) if word in native}


def _contents(package: str, path: Path) -> set[str]:
    folder = path.parent
    found = {
        item.name + "/" if item.is_dir() else item.name
        for item in folder.iterdir()
        if (item.is_dir() and (item / "__init__.py").is_file())
        or (item.suffix == ".py" and item.name != "__init__.py")
    }
    return found | {n.rpartition(".")[2] for n in NATIVE if n.rpartition(".")[0] == package}


def test_each_package_docstring_maps_exactly_its_modules():
    found = []
    for package, path in sorted(_packages().items()):
        docstring = ast.get_docstring(_parse(path)) or ""
        named, there = _mapped(docstring), _contents(package, path)
        if package == PLATFORMS:
            there -= {f"{name}.py" for name in _platform_modules()}
        if named != there:
            missing, stale = sorted(there - named), sorted(named - there)
            found.append(f"{package}: names none of {missing}; names {stale}, not there")
    assert found == [], "\n".join(found)


def _platform_modules() -> set[str]:
    """The modules of worker/plugin/platforms that define PLATFORM at their top level."""
    found = set()
    for path in (ROOT / PLATFORMS.replace(".", "/")).glob("*.py"):
        for node in _parse(path).body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Name) and t.id == "PLATFORM" for t in targets):
                found.add(path.stem)
    return found


def test_each_platform_module_defines_the_platform_of_its_name():
    from worker.plugin.platforms.platform import Platform

    modules = _platform_modules()
    assert {"cpu", "cuda", "rocm", "tpu"} <= modules
    for name in modules:
        platform = importlib.import_module(f"{PLATFORMS}.{name}").PLATFORM
        assert isinstance(platform, Platform) and platform.name == name, name


def test_the_map_reader_reads_names_not_paths():
    text = "records.py, dtypes.py  the records\n  cache/ the cache (see worker/wire, pool/executor)"
    assert _mapped(text) == {"records.py", "dtypes.py", "cache/"}
    assert _mapped("tests/test_structure.py reads *.py < wire/ < cache/") == {"wire/", "cache/"}
    assert _mapped("entries/<key>.pjx, ``plugins/``, ``x.py``, _pjrt") == {"_pjrt"}


def _lazy_packages() -> list[tuple[str, ast.Module]]:
    """The packages whose names are imported on first use (worker.lazy_names), parsed."""
    found = []
    for package, path in sorted(_packages().items()):
        tree = _parse(path)
        calls = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "on_first_use"
        ]
        if calls:
            found.append((package, tree))
    return found


def test_a_lazy_package_lists_its_names_once_in_its_type_checking_block():
    from worker.lazy_names import type_checking_imports

    packages = _lazy_packages()
    assert {name for name, _ in packages} == {"pool", "pool.cluster", "worker", "worker.cache"}
    for package, tree in packages:
        (block,) = [
            node
            for node in tree.body
            if isinstance(node, ast.If)
            and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING"
        ]
        listed = {}
        for node in block.body:
            assert isinstance(node, ast.ImportFrom), f"{package}: only imports in the block"
            for alias in node.names:
                # `Name as Name`: what type checkers take for a re-export.
                assert alias.asname == alias.name, f"{package}: import {alias.name} as itself"
                listed[alias.name] = node.module
        importlib.import_module(package)  # cheap: its names wait for their first use
        assert type_checking_imports(package) == listed
        stores = {
            target.id
            for node in tree.body
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        assert "__all__" not in stores, f"{package}: __all__ comes from the block"


# -- the guards of size: no drawer grows unnoticed ---------------------------------------------

LONGEST_FUNCTION = 80
"""The most lines a function of pool/ or worker/ may have: its lines that are neither blank nor
comments (the docstring counts)."""

LONG_FUNCTIONS: set[str] = set()
"""Functions let past LONGEST_FUNCTION, each on its way to being cut (none now)."""

TOP_OF_WORKER = 12
"""The most modules at the top of worker/: the shared records and the few helpers below every
package; everything else has a package of its own."""

MOST_DUPLICATES = 20
"""The most pairs of duplicated places (the `duplicates` command) in the tree."""


def _function_lengths() -> Iterator[tuple[str, int]]:
    for module, path in _modules():
        lines = path.read_text().splitlines()
        for node in ast.walk(_parse(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = lines[node.lineno - 1 : node.end_lineno]
                counted = [
                    line for line in body if line.strip() and not line.lstrip().startswith("#")
                ]
                yield f"{module}.{node.name}", len(counted)


def test_no_function_is_longer_than_the_guard():
    lengths = dict(_function_lengths())
    assert len(lengths) > 1000, "the walk reached pool/ and worker/"
    long = {
        name: n
        for name, n in lengths.items()
        if n > LONGEST_FUNCTION and name not in LONG_FUNCTIONS
    }
    assert not long, f"functions over {LONGEST_FUNCTION} lines (cut them into named steps): {long}"
    assert all(lengths.get(name, 0) > LONGEST_FUNCTION for name in LONG_FUNCTIONS), (
        "a function let past the guard is short now: take it off LONG_FUNCTIONS"
    )


def test_the_top_of_worker_holds_few_modules():
    top = sorted(path.name for path in (ROOT / "worker").glob("*.py"))
    assert len(top) <= TOP_OF_WORKER, f"{len(top)} modules at the top of worker/: {top}"


@pytest.mark.slow
def test_the_tree_repeats_itself_in_few_places():
    """The `duplicates` command (on PATH where the project is developed; CI may lack it) over
    the tree: pairs of places that share six or more lines of the same shape."""
    command = shutil.which("duplicates")
    if command is None:
        pytest.skip("the duplicates command is not on PATH")
    done = subprocess.run(
        [command, "--repo", str(ROOT), "--seconds", "300", "--most", "200"],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    first = done.stdout.splitlines()[0]
    assert "incomplete" not in done.stdout, done.stdout
    count = 0 if first.startswith("no duplicates") else int(first.split()[0])
    assert count <= MOST_DUPLICATES, done.stdout


# -- the folders beside the packages -----------------------------------------------------------

SCRIPT_FOLDERS = ("benchmarks", "tools", "tests")


def _scripts() -> Iterator[tuple[Path, ast.Module]]:
    for folder in SCRIPT_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path, _parse(path)


def test_no_script_patches_sys_path():
    """Benchmarks and tools import their neighbours as scripts do (their folder comes first on
    sys.path) and pjrt-pool as installed; the tests' fixtures are pytest's (tests/)."""
    for path, tree in _scripts():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "path":
                owner = node.value
                assert not (isinstance(owner, ast.Name) and owner.id == "sys"), (
                    f"{path.relative_to(ROOT)}:{node.lineno} uses sys.path"
                )
    assert not (ROOT / "scripts").exists(), "scripts/ is emptied by kind: benchmarks/, tools/"


def test_every_benchmark_measures_through_the_harness():
    """Each benchmark alternates its sides and prints ratios against a baseline of the same
    run: benchmarks/harness.py's compare(), not a loop of its own."""
    benchmarks = sorted((ROOT / "benchmarks").glob("bench_*.py"))
    assert len(benchmarks) > 10
    for path in benchmarks:
        tree = _parse(path)
        from_harness = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module == "harness"
            for alias in node.names
        }
        assert "compare" in from_harness or "ratio_line" in from_harness, path.name
        calls = {
            node.func.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        }
        imported = set(_imported_names(tree))
        uses_a_benchmark = any(name.startswith("bench_") for name in imported)
        assert "compare" in calls or uses_a_benchmark, f"{path.name} never calls compare()"


def test_tools_and_tests_import_no_benchmark():
    """Benchmarks may share code among themselves; tools and tests stand without them."""
    for path, tree in _scripts():
        if path.parent.name == "benchmarks":
            continue
        found = [n for n in _imported_names(tree) if n == "harness" or n.startswith("bench_")]
        assert not found, f"{path.relative_to(ROOT)} imports {found}"
