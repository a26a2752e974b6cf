"""Records about plugin builds in a cache's ``plugins/`` folder, checked as entries are.

What lies there changes what readers compute: a plugin's digest goes into
every key and every executable's stamp; whether a plugin knows an XLA flag
decides the flags it loads with (without ``--xla_cpu_enable_fast_min_max=false``,
``max(1, NaN)`` is 1); a probe's StableHLO window decides what lower()
serializes; check-plugin's outcomes decide a warning. So records get the
protections entries get:

- The folder is opened once and checked like ``entries/`` (folders.py), and
  a record is read only from a regular file of at most MEMO_LIMIT bytes,
  never through a symlink, and parsed with bounded nesting
  (worker.untrusted). A record that fails any of this is ignored: its value is
  computed again.
- With a signing secret (signing.py), every record written carries an
  HMAC-SHA256 of its name and content (the ``mac`` field, first in the
  file), and a record without the right one is ignored, so that whoever can
  write the cache but lacks the secret cannot change what a reader computes.
  The MAC is checked over the raw bytes that follow it before they are
  parsed: a record from whoever lacks the secret is never parsed. Without a secret,
  records are read as they are (the directory checks are then all there is,
  as for entries).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from worker.cache.atomic import write_atomically
from worker.cache.folders import Folder
from worker.cache.signing import Signer
from worker.log import get_logger
from worker.untrusted import parse_json, read_file

logger = get_logger("pjrt_pool.cache")

MEMO_LIMIT = 1 << 20
"""Bytes a record may have: the largest, check-plugin's outcomes, are about 40 KB."""

MAC_FIELD = "mac"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\.json")


def check_memo_name(name: str) -> str:
    """Returns name if it is a record's file name (letters, digits, "_.-", ".json"), else raises."""
    if not isinstance(name, str) or _NAME.fullmatch(name) is None or ".." in name:
        raise ValueError(f"{name!r} is not the name of a record in a cache's plugins/ folder")
    return name


def _signed_bytes(name: str, content: bytes) -> bytes:
    return b"pjrt-pool record\0" + name.encode() + b"\0" + content


# A signed record's file starts with its MAC, so that the MAC is checked over the raw bytes
# that follow before any of them is parsed: '{"mac": "<hex>", ' then the record's own JSON
# (without its opening brace, which the MAC covers as the record's first byte).
_SIGNED_START = re.compile(rb'\{"mac": "([0-9a-f]{64})", ')


class MemoStore:
    """The records of one cache's plugins/ folder (folder None: a cache without one)."""

    def __init__(self, folder: Folder | None, signer: Signer | None, mode: int = 0o600) -> None:
        self.folder = folder
        self.signer = signer
        self.mode = mode

    def read(self, name: str) -> dict[str, Any] | None:
        """Returns the record stored under name, or None if there is none that can be trusted.

        None for a missing, unreadable, oversized, malformed or (with a
        signer) unsigned or wrongly signed record; the mac field is removed.
        """
        check_memo_name(name)
        if self.folder is None:
            return None
        try:
            data = read_file(name, MEMO_LIMIT, dir_fd=self.folder.fd, what="record")
            if self.signer is not None:
                data = self._signed_content(name, data, self.signer)
                if data is None:
                    return None
            record = parse_json(data)
        except (OSError, ValueError) as error:
            if not isinstance(error, FileNotFoundError):
                logger.debug("ignoring the record %s: %s", self.folder.file(name), error)
            return None
        if not isinstance(record, dict):
            return None
        record.pop(MAC_FIELD, None)
        return record

    def _signed_content(self, name: str, data: bytes, signer: Signer) -> bytes | None:
        """The record's JSON after its MAC, if the MAC over those raw bytes is right."""
        start = _SIGNED_START.match(data)
        if start is None:
            logger.warning(
                "ignoring the unsigned record %s: this process signs the cache (secret from %s)",
                self.folder.file(name) if self.folder else name,
                signer.source,
            )
            return None
        content = b"{" + data[start.end() :]
        if not signer.verify(_signed_bytes(name, content), bytes.fromhex(start.group(1).decode())):
            logger.warning(
                "ignoring the record %s: its signature does not match (changed, or signed "
                "with another secret)",
                self.folder.file(name) if self.folder else name,
            )
            return None
        return content

    def write(self, name: str, record: dict[str, Any]) -> None:
        """Stores a JSON-ready record under name atomically, signed when there is a signer.

        Raises OSError when it cannot be written (a read-only cache, or one
        without a plugins/ folder).
        """
        check_memo_name(name)
        if self.folder is None:
            raise FileNotFoundError(f"the cache has no plugins/ folder for {name}")
        stored = {field: value for field, value in record.items() if field != MAC_FIELD}
        if not stored:
            raise ValueError(f"an empty record for {name}: a record holds at least one field")
        data = json.dumps(stored, indent=1, sort_keys=True).encode()
        if self.signer is not None:
            mac = self.signer.sign(_signed_bytes(name, data)).hex()
            data = b'{"' + MAC_FIELD.encode() + b'": "' + mac.encode() + b'", ' + data[1:]
        write_atomically(Path(name), data, self.mode, dir_fd=self.folder.fd)

    def names(self) -> list[str]:
        """The names of the records in the folder (none when there is no folder)."""
        if self.folder is None:
            return []
        try:
            with self.folder.listing() as items:
                return [item.name for item in items if _NAME.fullmatch(item.name)]
        except OSError:
            return []


def _is_hex(text: str) -> bool:
    return len(text) % 2 == 0 and all(c in "0123456789abcdef" for c in text)
