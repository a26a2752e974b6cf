"""JSON an attacker wrote, at the largest size each reader accepts: refused fast, never a crash.

Issue 29's items 5 and 6. Each reader of JSON that someone else may have
written (a cache entry's header, a plugin memo, a bundle's index, a
manifest) gets, at its own size bound, text made to stall a scanner (an
unterminated string of escaped quotes), to nest past any limit (brackets,
in UTF-8 and in UTF-16 and UTF-32, which json.loads would decode by
itself) and valid JSON nested past MAX_JSON_DEPTH; each must refuse it with
its usual error within a time limit. Real files and real readers; the
entry headers carry the right SHA-256, as anyone without the secret can
write them.
"""

from __future__ import annotations

import hashlib
import io
import struct
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import run_python

from pool.manifest import MAX_MANIFEST_SIZE, ManifestError, load_manifest
from worker.bundle.index import MAX_INDEX_SIZE
from worker.bundle.reader import Bundle
from worker.cache import DiskCache, entry
from worker.cache.entry import MAX_HEADER_SIZE, CorruptEntryError
from worker.cache.memos import MEMO_LIMIT
from worker.cache.signing import Signer
from worker.errors import BundleError
from worker.untrusted import MAX_JSON_DEPTH, parse_json

SECONDS = 5.0
"""Time any reader may take for its largest hostile input (a linear parse: well under 1 s)."""

KEY = hashlib.sha256(b"a key").hexdigest()


def escaped_quotes(size: int) -> bytes:
    """Brackets enough to need a depth check, then an unterminated string of escaped quotes.

    A scanner that looks for a string's end from each quote in turn reads
    the rest of the text from every one of them: quadratic.
    """
    return (b"[" * (MAX_JSON_DEPTH + 1) + b'"' + b'\\"' * size)[:size]


def brackets(size: int) -> bytes:
    return b"[" * size


def hidden_nesting(levels: int) -> str:
    """Nesting that a UTF-8 view of its UTF-16 or UTF-32 bytes shows inside a string.

    U+0122's low byte is a quote: read as UTF-8, the text's quotes pair up so
    that the brackets fall between two of them, and a bracket count that
    skips strings finds no nesting at all.
    """
    return '["\u0122", ' + "[" * levels + "]" * levels + ', "\u0122"]'


def utf16_brackets(size: int) -> bytes:
    return hidden_nesting(size // 4 - 8).encode("utf-16-le")


def utf32_brackets(size: int) -> bytes:
    return hidden_nesting(size // 8 - 8).encode("utf-32")  # with its byte order mark


def deep_but_valid(size: int) -> bytes:
    """Valid JSON nested 1000 levels (within the parser's 1024), padded to size."""
    return b"[" * 1000 + b" " * (size - 2000) + b"]" * 1000


HOSTILE: dict[str, Callable[[int], bytes]] = {
    "escaped-quotes": escaped_quotes,
    "brackets": brackets,
    "utf16-brackets": utf16_brackets,
    "utf32-brackets": utf32_brackets,
    "deep-but-valid": deep_but_valid,
}


def timed(read: Callable[[], object]) -> float:
    start = time.perf_counter()
    read()
    return time.perf_counter() - start


# -- parse_json itself --------------------------------------------------------------------


@pytest.mark.parametrize("name", HOSTILE)
def test_parse_json_refuses_each_hostile_text_as_a_value_error(name: str) -> None:
    text = HOSTILE[name](1 << 20)
    with pytest.raises(ValueError) as caught:
        parse_json(text)
    if "brackets" in name and name != "brackets":
        assert "must be UTF-8 text" in str(caught.value)
    elif name != "escaped-quotes":
        assert f"nested deeper than {MAX_JSON_DEPTH} levels" in str(caught.value)


def test_parse_json_takes_utf8_json_at_its_depth_limit_and_refuses_one_more() -> None:
    at_limit = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert parse_json(at_limit) == parse_json(memoryview(at_limit)) == parse_json(at_limit.decode())
    deeper = '{"a": ' * (MAX_JSON_DEPTH + 1) + "1" + "}" * (MAX_JSON_DEPTH + 1)
    with pytest.raises(ValueError, match="nested deeper"):
        parse_json(deeper)
    assert parse_json('{"é": [1, 2.5, "ü", null, true]}'.encode()) == {
        "é": [1, 2.5, "ü", None, True]
    }
    utf16, utf16_le = '{"a": 1}'.encode("utf-16"), '{"a": 1}'.encode("utf-16-le")
    for not_utf8 in (utf16, utf16_le, b"\xef\xbb\xbf[]"):
        with pytest.raises(ValueError, match="must be UTF-8 text"):
            parse_json(not_utf8)
    with pytest.raises(ValueError):
        parse_json(b'["\xe9"]')  # Latin-1, not UTF-8


def test_no_segfault_under_a_raised_recursion_limit() -> None:
    # json.loads decodes UTF-16 by itself and recurses once per level: with the limit
    # raised, 300,000 levels overflow the C stack (SIGSEGV). In a child, which must live.
    done = run_python(
        """
        import sys
        sys.setrecursionlimit(10**7)
        from worker.untrusted import parse_json
        hidden = '["\\u0122", ' + "[" * 300_000 + "]" * 300_000 + ', "\\u0122"]'
        for text in (hidden.encode("utf-16-le"), hidden.encode("utf-32"),
                     b"[" * 300_000, "[" * 300_000, b"[" * 1000 + b"]" * 1000):
            try:
                parse_json(text)
            except ValueError as error:
                print("refused:", str(error)[:40])
        """,
        timeout=60,
    )
    assert done.stdout.count("refused:") == 5


# -- the readers, each at its own bound ----------------------------------------------------


def entry_file(header: bytes) -> bytes:
    """A cache entry with this header and its right SHA-256: no secret needed to write it."""
    prefix = struct.pack("<8sIII", entry.MAGIC, entry.FORMAT_VERSION, 0, len(header))
    return prefix + header + hashlib.sha256(prefix + header).digest() + b"payload"


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
@pytest.mark.parametrize("name", HOSTILE)
def test_a_cache_entry_header_at_its_bound(tmp_path: Path, name: str, signed: bool) -> None:
    signer = Signer(b"a-secret-only-the-team-holds-0123456789", "test") if signed else None
    cache = DiskCache(tmp_path / "cache", signer=signer)
    cache.path_of(KEY).parent.mkdir(parents=True, exist_ok=True)
    cache.path_of(KEY).write_bytes(entry_file(HOSTILE[name](MAX_HEADER_SIZE)))

    # Signed, the entry's MAC is checked before its header is parsed: a hostile
    # header without one is refused unread.
    refusal = "unsigned, and this process signs entries" if signed else "header is not JSON"

    def read() -> None:
        with pytest.raises(CorruptEntryError, match=refusal):
            cache.read(KEY)

    assert timed(read) < SECONDS


@pytest.mark.parametrize("name", HOSTILE)
def test_a_plugin_memo_at_its_bound(tmp_path: Path, name: str) -> None:
    cache = DiskCache(tmp_path / "cache", signer=None)
    cache.plugins_dir.mkdir(parents=True, exist_ok=True)
    (cache.plugins_dir / "sha256-x.json").write_bytes(HOSTILE[name](MEMO_LIMIT))
    assert timed(lambda: cache.memos.read("sha256-x.json")) < SECONDS
    assert cache.memos.read("sha256-x.json") is None  # ignored, as any untrusted record


def bundle_with_index(path: Path, index: bytes) -> Path:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as archive:
        info = tarfile.TarInfo("index.json")
        info.size = len(index)
        archive.addfile(info, io.BytesIO(index))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name", HOSTILE)
def test_a_bundle_index_at_its_bound(tmp_path: Path, name: str) -> None:
    bundle = bundle_with_index(tmp_path / "hostile.bundle", HOSTILE[name](MAX_INDEX_SIZE))

    def read() -> None:
        with pytest.raises(BundleError, match=r"index\.json is not JSON"):
            Bundle(bundle, signer=None)
        with pytest.raises(ManifestError, match="is not JSON"):
            load_manifest(bundle)

    assert timed(read) < 2 * SECONDS


@pytest.mark.slow
@pytest.mark.parametrize("name", ["escaped-quotes", "utf16-brackets", "deep-but-valid"])
def test_a_manifest_at_its_bound(tmp_path: Path, name: str) -> None:
    manifest = tmp_path / "hostile.json"
    manifest.write_bytes(HOSTILE[name](MAX_MANIFEST_SIZE))

    # UTF-16 text has NUL bytes, which no manifest of ours (UTF-8 JSON) has: the
    # file is read as a damaged bundle, and refused as one.
    refusal = "member header at offset 0" if name == "utf16-brackets" else "cannot read manifest"

    def read() -> None:
        with pytest.raises(ManifestError, match=refusal):
            load_manifest(manifest)

    assert timed(read) < 2 * SECONDS
