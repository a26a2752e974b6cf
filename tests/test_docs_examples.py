"""Every Python and shell example in README.md and docs/*.md runs as written, and the docs hold.

Examples are the fenced blocks whose info string is python (or py) or bash
(or sh, shell); other fences (none, text) hold output or synopses. Each
example runs in a fresh temporary directory, which stands for the
checkout's root (a copy of tools/ is there, for the pages that run one),
with its own PJRT_POOL_CACHE_DIR and this interpreter's
bin/ first on PATH (so `python` and `pjrt-pool` are this environment's): a
Python block as a file in a fresh interpreter, a shell block with bash -e
-o pipefail; pjrt-pool is the installed one, example programs included
(pool.examples). A block fails the test when it exits non-zero, showing its
first line, stdout and stderr.

An HTML comment right before a fence (blank lines between are fine) says
what a block needs; a block without one must run:

    <!-- example: needs WHAT (why) -->  skipped, with that reason: a GPU, a TPU, a
                                        cluster, a network, an install; a shell block
                                        is still checked with bash -n
    <!-- example: requires NAME ... --> run where each NAME is an importable module or
                                        a command on PATH, else skipped
    <!-- example: continues -->         runs after the page's previous example, in its
                                        directory (they are one test)
    <!-- example: slow -->              marked slow

Items combine with commas ("slow, continues"); needs comes last.

A section whose text starts "Needs the `cpu` and `remote` extras" (a
Quickstart of the README: every one says so) runs its examples in an
environment with only those extras of pjrt-pool (extras_helpers: this one,
less the packages of the others); where one of them is not installed here,
the example must fail saying how to install it, in its last line on
stderr. Each such example is run again without each extra it names but
cpu, and must fail so too (test_example_without_an_extra_names_it).

The other tests: the README's main job, which installs and so only gets
bash -n, is after its install the Quickstart block that runs; the README
stays short and its table of contents reaches every section; every
relative link and anchor in the docs resolves; the docs index lists every
page; install commands name this checkout (no index serves pjrt-pool) and
its extras; every command-line option and environment variable is
documented.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import REPO
from extras_helpers import installed, make_environment

from worker.extras import install_extra_command

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_LIMIT = 350
LANGUAGES = {"python": "python", "py": "python", "bash": "shell", "sh": "shell", "shell": "shell"}
TIMEOUT = 600

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_MARKER = re.compile(r"^\s*<!--\s*example:\s*(.*?)\s*-->\s*$")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_NEEDS_EXTRAS = re.compile(r"^Needs the ((?:`[\w-]+`(?:, | and )?)+) extras?\b")


@dataclass
class Block:
    """One fenced block of a page."""

    page: Path
    line: int  # of the opening fence, 1-based
    language: str  # "python", "shell", or "" for the rest
    code: str
    marker: str | None = None
    extras: frozenset[str] | None = None
    """The extras its section says it needs, at its top ("Needs the `cpu` extra"), or None."""


@dataclass
class Example:
    """A block that runs, with the blocks that continue it, and what its marker says."""

    blocks: list[Block]
    needs: str | None = None
    requires: list[str] = field(default_factory=list)
    slow: bool = False
    extras: frozenset[str] | None = None
    """The extras of pjrt-pool it runs with, alone (its section's); None: this environment's."""

    @property
    def name(self) -> str:
        first = self.blocks[0]
        return f"{first.page.relative_to(REPO)}:{first.line}"


def blocks_of(page: Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of a page, in order, each with the marker comment right before it."""
    lines = (page.read_text(encoding="utf-8") if text is None else text).splitlines()
    found: list[Block] = []
    number = 0
    extras: frozenset[str] | None = None
    section_start = False  # the next text line is the first of a section
    while number < len(lines):
        opening = _FENCE.match(lines[number])
        if not opening:
            if _HEADING.match(lines[number]):
                extras, section_start = None, True
            elif section_start and lines[number].strip():
                needs = _NEEDS_EXTRAS.match(lines[number])
                extras = frozenset(re.findall(r"`([\w-]+)`", needs.group(1))) if needs else None
                section_start = False
            number += 1
            continue
        indent, fence, info = opening.groups()
        marker = None
        before = number - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        if before >= 0 and (match := _MARKER.match(lines[before])):
            marker = match.group(1)
        body: list[str] = []
        number += 1
        while number < len(lines):
            line = lines[number]
            stripped = line.strip()
            if stripped.startswith(fence[0] * len(fence)) and not stripped.strip(fence[0]):
                break
            body.append(line[len(indent) :] if line.startswith(indent) else line)
            number += 1
        start = number - len(body)  # the opening fence's 1-based number
        language = LANGUAGES.get(info.lower(), "")
        found.append(Block(page, start, language, "\n".join(body), marker, extras))
        number += 1
    return found


def parse_marker(text: str) -> dict[str, object]:
    """The items of a marker: needs (its text), requires (names), continues, slow."""
    items: dict[str, object] = {}
    rest = text.strip()
    while rest:
        if rest.startswith("needs "):
            items["needs"] = rest[len("needs ") :].strip()
            break
        item, _, rest = rest.partition(",")
        item, rest = item.strip(), rest.strip()
        if item in ("continues", "slow"):
            items[item] = True
        elif item.startswith("requires "):
            items["requires"] = item.split()[1:]
        else:
            raise ValueError(f"unknown example marker item {item!r} in {text!r}")
    return items


def examples_of(page: Path, text: str | None = None) -> list[Example]:
    """The page's examples: each runnable block, and the blocks that continue it."""
    found: list[Example] = []
    for block in blocks_of(page, text):
        if not block.language:
            assert block.marker is None, f"{page}:{block.line}: a marker on a block that never runs"
            continue
        items = parse_marker(block.marker or "")
        if items.get("continues"):
            assert found, f"{page}:{block.line}: continues, but no example comes before it"
            found[-1].blocks.append(block)
            found[-1].slow |= bool(items.get("slow"))
            continue
        found.append(
            Example(
                [block],
                needs=items.get("needs"),  # type: ignore[arg-type]
                requires=list(items.get("requires", [])),  # type: ignore[call-overload]
                slow=bool(items.get("slow")),
                extras=block.extras,
            )
        )
    return found


def _all_examples() -> list[Example]:
    return [example for page in PAGES for example in examples_of(page)]


def _params() -> list[object]:
    return [
        pytest.param(e, id=e.name, marks=[pytest.mark.slow] if e.slow else [])
        for e in _all_examples()
    ]


def _available(name: str) -> bool:
    return shutil.which(name) is not None or importlib.util.find_spec(name) is not None


def _environment(directory: Path, bin_dir: Path) -> dict[str, str]:
    """This environment, without the user's pjrt-pool settings but the plugins', in `directory`,
    with bin_dir (its python and pjrt-pool) first on PATH."""
    environment = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PJRT_POOL_") or k.startswith("PJRT_POOL_PLUGIN_")
    }
    environment.pop("VIRTUAL_ENV", None)
    environment["PJRT_POOL_CACHE_DIR"] = str(directory / "cache")
    # pjrt-pool as installed (editable from this checkout, or, in .ci/run's quickstart
    # leg, built from it as the README's main job installs it): not the checkout's
    # sources on PYTHONPATH, which hold no native module of a built install.
    environment["PATH"] = os.pathsep.join([str(bin_dir), os.environ["PATH"]])
    return environment


def _tail(text: str, limit: int = 4000) -> str:
    return text if len(text) <= limit else "...\n" + text[-limit:]


def run_block(
    block: Block, directory: Path, environment: dict[str, str], bin_dir: Path, fails: bool = False
) -> subprocess.CompletedProcess[str]:
    """Runs one block in directory with bin_dir's python; fails the test with its first line
    and output if it fails (unless fails: then the caller checks what it says)."""
    if block.language == "python":
        script = directory / f"example_{block.line}.py"
        script.write_text(block.code + "\n", encoding="utf-8")
        command = [str(bin_dir / "python"), script.name]
    else:
        script = directory / f"example_{block.line}.sh"
        script.write_text(block.code + "\n", encoding="utf-8")
        command = ["bash", "-e", "-o", "pipefail", script.name]
    done = subprocess.run(
        command,
        cwd=directory,
        env=environment,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    if done.returncode != 0 and not fails:
        first = next((line for line in block.code.splitlines() if line.strip()), "")
        pytest.fail(
            f"{block.page.relative_to(REPO)}:{block.line}: the example starting {first!r} "
            f"exited {done.returncode}\n--- stdout\n{_tail(done.stdout)}\n--- stderr\n"
            f"{_tail(done.stderr)}",
            pytrace=False,
        )
    return done


@pytest.fixture(scope="session")
def environments(tmp_path_factory: pytest.TempPathFactory):
    """The bin directory of an environment with only some extras (extras_helpers), made once
    per set of extras."""
    made: dict[frozenset[str], Path] = {}

    def of(extras: frozenset[str]) -> Path:
        if extras not in made:
            made[extras] = make_environment(tmp_path_factory.mktemp("environment"), set(extras))
        return made[extras]

    return of


def _run_example(example: Example, directory: Path, bin_dir: Path, fails: bool = False) -> str:
    """Runs an example's blocks in directory with bin_dir's python and pjrt-pool; with fails,
    until one fails, and returns the last line it printed on stderr (failing the test if
    none fails)."""
    environment = _environment(directory, bin_dir)
    shutil.copytree(
        REPO / "tools", directory / "tools", ignore=shutil.ignore_patterns("__pycache__")
    )
    for block in example.blocks:
        done = run_block(block, directory, environment, bin_dir, fails)
        if done.returncode != 0:
            return (done.stderr.strip().splitlines() or [""])[-1]
    if fails:
        pytest.fail(f"{example.name} ran to its end", pytrace=False)
    return ""


def _assert_names_install(line: str, extra: str, example: Example) -> None:
    command = install_extra_command(extra)
    assert command in line, f"{example.name}: its last line does not say {command!r}: {line}"


@pytest.mark.parametrize("example", _params())
def test_example_runs_as_written(example: Example, tmp_path: Path, environments) -> None:
    if example.needs:
        for block in example.blocks:
            if block.language == "shell":
                syntax = subprocess.run(["bash", "-n"], input=block.code, text=True, check=False)
                assert syntax.returncode == 0, f"{example.name}: not valid bash"
        pytest.skip(f"needs {example.needs}")
    missing = [name for name in example.requires if not _available(name)]
    if missing:
        pytest.skip(f"requires {', '.join(missing)}, not installed here")
    if example.extras is None:
        _run_example(example, tmp_path, Path(sys.executable).parent)
        return
    absent = sorted(extra for extra in example.extras if not installed(extra))
    bin_dir = environments(example.extras)
    if absent:  # as a user without them meets it: one line saying how to install one
        line = _run_example(example, tmp_path, bin_dir, fails=True)
        assert any(install_extra_command(extra) in line for extra in absent), (
            f"{example.name}: {', '.join(absent)} not installed here, and its last line names "
            f"none of them: {line}"
        )
        return
    _run_example(example, tmp_path, bin_dir)


def _without_an_extra() -> list[object]:
    return [
        pytest.param(example, extra, id=f"{example.name} without {extra}")
        for example in _all_examples()
        if example.extras is not None and not example.needs
        for extra in sorted(example.extras - {"cpu"})
    ]


@pytest.mark.parametrize(("example", "extra"), _without_an_extra())
def test_example_without_an_extra_names_it(
    example: Example, extra: str, tmp_path: Path, environments
) -> None:
    """A quickstart run where one extra it names is missing fails saying how to install it:
    the one line of a command, or a traceback's last line (MissingExtraError's)."""
    line = _run_example(example, tmp_path, environments(example.extras - {extra}), fails=True)
    _assert_names_install(line, extra, example)


def test_every_quickstart_says_at_its_top_which_extras_it_needs() -> None:
    readme = REPO / "README.md"
    text = readme.read_text(encoding="utf-8")
    quickstart = text[
        text.index("## Quickstart") : text.index("\n## ", text.index("## Quickstart") + 1)
    ]
    unnamed = [
        example.name
        for example in examples_of(readme, quickstart)
        if not example.needs and example.extras is None
    ]
    assert not unnamed, f"Quickstart examples whose section names no extras: {unnamed}"
    named = {e.name: e.extras for e in examples_of(readme) if e.extras and not e.needs}
    assert len(named) >= 6 and len(_without_an_extra()) >= 3, named


def test_the_main_job_after_its_install_is_the_quickstart_that_runs() -> None:
    """The README's main job is only syntax-checked (it installs); the Quickstart block that
    runs must be the same commands, so that what the main job does is tested."""
    readme = REPO / "README.md"
    shell = [b for b in blocks_of(readme) if b.language == "shell"]
    main_job = next(b for b in shell if "pip install '.[cpu]'" in b.code)
    steps = [step.strip() for step in main_job.code.split("&&")]
    installs = ("python3 -m venv", ".venv/bin/pip install")
    after_install = [
        step.removeprefix(".venv/bin/") for step in steps if not step.startswith(installs)
    ]
    assert after_install[0].startswith("pjrt-pool warm"), steps
    assert any(b.code.strip().splitlines() == after_install for b in shell), after_install


# -- the extraction itself ------------------------------------------------------------


def test_blocks_markers_and_continuations_are_read_as_documented() -> None:
    page = REPO / "sample.md"
    text = (
        "# T\n\n```\nsynopsis, not run\n```\n\n<!-- example: needs gpu (a CUDA device) -->\n"
        "```bash\nnvidia-smi\n```\n\n```python\nx = 1\n```\n\n<!-- example: slow, continues -->\n\n"
        "```py\nassert x\n```\n\n<!-- example: requires flax optax -->\n```sh\necho\n```\n\n"
        "- item\n\n  ```python\n  y = 2\n  ```\n"
    )
    examples = examples_of(page, text)
    assert [(e.name, len(e.blocks), e.needs, e.requires, e.slow) for e in examples] == [
        ("sample.md:8", 1, "gpu (a CUDA device)", [], False),
        ("sample.md:12", 2, None, [], True),
        ("sample.md:23", 1, None, ["flax", "optax"], False),
        ("sample.md:29", 1, None, [], False),
    ]
    assert examples[1].blocks[1].code == "assert x" and examples[3].blocks[0].code == "y = 2"
    with pytest.raises(ValueError, match="unknown example marker"):
        examples_of(page, "<!-- example: skip -->\n```bash\ntrue\n```\n")


def test_every_page_has_examples_and_most_of_them_run() -> None:
    examples = _all_examples()
    assert len({e.blocks[0].page for e in examples}) >= 10
    skipped = [e for e in examples if e.needs]
    assert len(skipped) * 3 < len(examples), [e.name for e in skipped]


# -- the README and the links ---------------------------------------------------------


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings_of(page: Path) -> list[tuple[int, str]]:
    """The page's headings (level, text) outside fenced blocks."""
    found, fence = [], None
    for line in page.read_text(encoding="utf-8").splitlines():
        opening = _FENCE.match(line)
        if opening and fence is None:
            fence = opening.group(2)[0]
            continue
        if fence is not None:
            if line.strip() and not line.strip().strip(fence):
                fence = None
            continue
        if match := _HEADING.match(line):
            found.append((len(match.group(1)), match.group(2)))
    return found


def anchors_of(page: Path) -> set[str]:
    anchors: set[str] = set()
    for _, text in headings_of(page):
        slug, number = _slug(text), 1
        while slug in anchors:  # GitHub numbers repeated headings: name, name-1, name-2
            slug = f"{_slug(text)}-{number}"
            number += 1
        anchors.add(slug)
    return anchors


def links_of(page: Path) -> list[str]:
    """The targets of the page's Markdown links, outside fenced blocks."""
    return _LINK.findall("\n".join(_without_fences(page.read_text(encoding="utf-8"))))


def _without_fences(text: str) -> list[str]:
    """The lines outside fenced blocks, HTML comments (invisible: the markers) taken out."""
    kept, fence = [], None
    for line in re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL).splitlines():
        opening = _FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(2)[0]
        elif fence is not None and line.strip() and not line.strip().strip(fence):
            fence = None
        elif fence is None:
            kept.append(line)
    return kept


def test_readme_is_short_with_a_table_of_contents_of_every_section() -> None:
    readme = REPO / "README.md"
    lines = readme.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_LIMIT, (
        f"README.md has {len(lines)} lines; keep it to {README_LIMIT}"
    )
    start = lines.index("## Contents")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("#"))
    contents = _LINK.findall("\n".join(_without_fences("\n".join(lines[start:end]))))
    local = [target[1:] for target in contents if target.startswith("#")]
    sections = [_slug(text) for level, text in headings_of(readme) if level in (2, 3)]
    assert set(local) <= set(sections), set(local) - set(sections)
    missing = [s for s in sections if s not in local and s != "contents"]
    assert not missing, f"sections missing from the table of contents: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_reach_files_and_headings_that_exist(page: Path) -> None:
    broken = []
    for target in links_of(page):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors_of(linked):
            broken.append(f"{target}: no such heading in {linked.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: {broken}"


def test_the_docs_index_lists_every_page() -> None:
    index = REPO / "docs" / "README.md"
    listed = {Path(t.partition("#")[0]).name for t in links_of(index)}
    pages = {p.name for p in (REPO / "docs").glob("*.md")} - {"README.md"}
    assert pages <= listed, pages - listed


# -- install commands, options and variables ----------------------------------------------


def test_install_commands_name_this_checkout_and_its_extras() -> None:
    extras = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    wrong = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for arguments in re.findall(r"pip install([^\n`&;|]*)", text):
            for word in arguments.replace("'", " ").replace('"', " ").split():
                if re.fullmatch(r"pjrt[-_]pool(\[[\w,-]*\])?", word):
                    wrong.append(f"{page.name}: pip install {word}: no index serves pjrt-pool")
        for requested in re.findall(r"(?:^|[\s'\"/])(?:\.|\S+\.whl)\[([\w,-]+)\]", text):
            wrong += [
                f"{page.name}: no extra {e!r}" for e in requested.split(",") if e not in extras
            ]
    assert not wrong, wrong


def _options(parser: argparse.ArgumentParser, path: str = "") -> dict[str, set[str]]:
    """Each command's long options, by command path ("warm", "cache gc")."""
    found: dict[str, set[str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(_options(sub, f"{path} {name}".strip()))
        elif path:
            found.setdefault(path, set()).update(
                o for o in action.option_strings if o.startswith("--") and o != "--help"
            )
    return found


def test_every_command_and_option_is_in_the_command_line_page() -> None:
    from pool.cli.main import build_parser

    text = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    missing = [
        f"{command} {option}"
        for command, options in _options(build_parser()).items()
        for option in sorted(options | {command.split()[-1]})
        if option not in text
    ]
    assert not missing, f"docs/cli.md does not mention: {missing}"


def test_every_environment_variable_is_in_the_environment_page() -> None:
    text = (REPO / "docs" / "environment.md").read_text(encoding="utf-8")
    variables = {
        name
        for folder in ("pool", "worker")
        for source in (REPO / folder).rglob("*.py")
        for name in re.findall(r"[\"'](PJRT_POOL_[A-Z_]+)[\"']", source.read_text(encoding="utf-8"))
    }
    variables = {
        "PJRT_POOL_PLUGIN_<PLATFORM>" if v == "PJRT_POOL_PLUGIN_" else v for v in variables
    }
    assert len(variables) > 15
    missing = sorted(v for v in variables if v not in text)
    assert not missing, f"docs/environment.md does not mention: {missing}"
