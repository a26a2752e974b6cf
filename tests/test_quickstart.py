"""The README's Quickstart runs as written.

The Python code blocks under the "## Quickstart" heading (up to the next
heading of the same or a higher level) run, in order, as one script in a
fresh interpreter with an empty cache directory.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO, run_python

README = REPO / "README.md"

_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


def quickstart_code(markdown: str) -> str | None:
    """Returns the Quickstart's Python blocks joined in order, or None without the heading.

    Blocks fenced as ```python, ```py or ```pycon count; in pycon blocks only
    the ``>>>``/``...`` lines run.
    """
    lines = markdown.splitlines()
    start = level = None
    for number, line in enumerate(lines):
        match = _HEADING.match(line)
        if match and match.group(2).strip().lower() == "quickstart":
            start, level = number + 1, len(match.group(1))
            break
    if start is None:
        return None
    blocks: list[str] = []
    fence = None
    language = ""
    body: list[str] = []
    indent = ""
    for line in lines[start:]:
        if fence is None:
            heading = _HEADING.match(line)
            if heading and len(heading.group(1)) <= level:
                break
            opening = _FENCE.match(line)
            if opening:
                indent, fence, language = opening.group(1), opening.group(2), opening.group(3)
                body = []
            continue
        if line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
            if language.lower() in ("python", "py", "python3"):
                blocks.append("\n".join(body))
            elif language.lower() == "pycon":
                blocks.append(
                    "\n".join(
                        row.strip()[4:]
                        for row in body
                        if row.strip().startswith((">>> ", "... ")) or row.strip() in (">>>", "...")
                    )
                )
            fence = None
            continue
        body.append(line[len(indent) :] if line.startswith(indent) else line)
    return "\n\n".join(blocks)


def test_quickstart_extraction_finds_only_the_quickstart_python_blocks():
    sample = (
        "# Title\n\n```python\nprint('intro')\n```\n\n## Quickstart\n\nInstall:\n\n"
        "```bash\npip install pjrt-pool\n```\n\n```python\nx = 1\n```\n\n### Details\n\n"
        "```python\nif x:\n    y = 2\n```\n\n## Next\n\n```python\nprint('later')\n```\n"
    )
    assert quickstart_code(sample) == "x = 1\n\nif x:\n    y = 2"
    assert quickstart_code("# Title\n\n## Usage\n") is None


def test_readme_quickstart_runs(tmp_path: Path):
    code = quickstart_code(README.read_text(encoding="utf-8"))
    if code is None:
        pytest.skip("README.md has no '## Quickstart' section yet")
    assert code.strip(), "the Quickstart section has no ```python code block"
    run_python(code, env={"PJRT_POOL_CACHE_DIR": str(tmp_path / "cache")}, timeout=300)
