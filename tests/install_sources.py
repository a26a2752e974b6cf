"""Where pjrt-pool can have been installed from, as pip records it (PEP 610's
direct_url.json; None: from an index, which records none), and the command that installs
one of its extras from there: shared by the tests of missing extras (test_extras.py) and
of missing plugins (test_plugins.py), which must name the same commands."""

from __future__ import annotations

import json
from pathlib import Path

WHEEL = "/srv/dist/pjrt_pool-0.1.0-cp311-cp311-linux_x86_64.whl"

SOURCES: dict[str, tuple[dict | None, str]] = {
    "an editable checkout": (
        {"url": "file:///home/me/pjrt-pool", "dir_info": {"editable": True}},
        "pip install -e '/home/me/pjrt-pool[{extra}]'",
    ),
    "a checkout": (
        {"url": "file:///home/me/pjrt%20pool", "dir_info": {}},
        "pip install '/home/me/pjrt pool[{extra}]'",
    ),
    "a wheel": (
        {"url": f"file://{WHEEL}", "archive_info": {}},
        f"pip install '{WHEEL}[{{extra}}]'",
    ),
    "a git repository": (
        {
            "url": "https://example.com/pjrt-pool.git",
            "vcs_info": {"vcs": "git", "commit_id": "0123abc"},
        },
        "pip install 'pjrt-pool[{extra}] @ git+https://example.com/pjrt-pool.git@0123abc'",
    ),
    "an index (nothing recorded)": (
        None,
        "pip install '<the checkout or wheel pjrt-pool came from>[{extra}]'",
    ),
}
"""By source: its direct_url.json, and the command for an extra ({extra} in it)."""


def installed_as(place: Path, direct_url: dict | None) -> Path:
    """A pjrt-pool distribution's metadata in `place`, as pip records it; returns `place`."""
    info = place / "pjrt_pool-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pjrt-pool\nVersion: 0.1.0\n")
    if direct_url is not None:
        (info / "direct_url.json").write_text(json.dumps(direct_url))
    return place
