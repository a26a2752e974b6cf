"""With a signing secret, a file's MAC is checked over its raw bytes before anything is parsed.

Whoever can write a shared cache but lacks the secret can put any bytes in
an entry's header or a plugin record: with signing on, neither is parsed
unless its MAC is right, so a header crafted to make a JSON reader slow (or
to exhaust it) costs a digest and a MAC (issue 29, the ordering of item 5).
Each read runs in a child process under a time limit, with the largest
file its reader accepts.
"""

from __future__ import annotations

import json

from conftest import run_python

from worker.cache.entry import MAX_HEADER_SIZE
from worker.cache.memos import MEMO_LIMIT

SECRET = "a-secret-only-the-team-holds-0123456789"
LIMIT = 30
"""Seconds: a read checks a digest and a MAC in milliseconds; parsing these would take hours."""

ENTRY = """
import hashlib, struct, time
from worker.cache import DiskCache, entry
from worker.cache.signing import Signer
flags = {flags}
# Brackets enough to be checked for depth, then an unterminated string of escaped quotes.
header = (b"[" * 65 + b'"\\\\' * ({size} // 2))[:{size}]
prefix = struct.pack("<8sIII", entry.MAGIC, entry.FORMAT_VERSION, flags, len(header))
mac = b"\\x01" * 32 if flags else b""
data = prefix + header + hashlib.sha256(prefix + header).digest() + mac
cache = DiskCache({directory!r}, signer=Signer({secret!r}.encode(), "test"))
key = "ab" * 32
(cache.entries_dir / f"{{key}}.pjx").write_bytes(data)
started = time.perf_counter()
try:
    cache.read(key)
except entry.CorruptEntryError as error:
    print(type(error).__name__, "|", error, "|", time.perf_counter() - started)
"""

MEMO = """
import logging, time
from worker.cache import DiskCache
from worker.cache.signing import Signer
logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(message)s")
cache = DiskCache({directory!r}, signer=Signer({secret!r}.encode(), "test"))
start = b'{{"mac": "' + b"0" * 64 + b'", "value": ' + b"[" * 65
body = (b'"\\\\' * {size})[: {size} - len(start)]
(cache.plugins_dir / "sha256-x.json").write_bytes(start + body)
started = time.perf_counter()
print(cache.memos.read("sha256-x.json"), time.perf_counter() - started)
"""


def test_an_entry_header_is_not_parsed_before_its_mac_is_checked(tmp_path):
    for flags, says in ((1, "signed with another secret"), (0, "unsigned, and this process")):
        code = ENTRY.format(
            flags=flags, size=MAX_HEADER_SIZE, directory=str(tmp_path / f"c{flags}"), secret=SECRET
        )
        done = run_python(code, timeout=LIMIT)
        kind, message, seconds = done.stdout.strip().split(" | ")
        assert kind == "SignatureError" and says in message, done.stdout
        assert float(seconds) < 1, seconds


def test_a_plugin_record_is_not_parsed_before_its_mac_is_checked(tmp_path):
    code = MEMO.format(size=MEMO_LIMIT, directory=str(tmp_path / "cache"), secret=SECRET)
    done = run_python(code, timeout=LIMIT)
    value, seconds = done.stdout.split()
    assert value == "None" and float(seconds) < 1, done.stdout
    assert "WARNING ignoring the record" in done.stderr
    assert "signature does not match" in done.stderr
    assert "not JSON" not in done.stderr and "nested" not in done.stderr


def test_a_signed_record_reads_back(tmp_path):
    from worker.cache import DiskCache
    from worker.cache.signing import Signer

    cache = DiskCache(tmp_path / "cache", signer=Signer(SECRET.encode(), "test"))
    cache.memos.write("sha256-y.json", {"identity": [1, "a"], "value": "v"})
    assert cache.memos.read("sha256-y.json") == {"identity": [1, "a"], "value": "v"}
    raw = (cache.plugins_dir / "sha256-y.json").read_bytes()
    assert json.loads(raw)["mac"] and raw.startswith(b'{"mac": "')
    (cache.plugins_dir / "sha256-y.json").write_bytes(raw.replace(b'"v"', b'"w"'))
    assert cache.memos.read("sha256-y.json") is None
