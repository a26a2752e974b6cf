"""Benchmark: parse_json (orjson) against json.loads, and what importing orjson costs.

Usage::

    python benchmarks/bench_json.py [--rounds N]

Three measures, each against a baseline taken in the same run:

1. Import: fresh interpreters (``python -X importtime -c "import M"``),
   --rounds times each, alternated (benchmarks/harness.py); the medians of the cumulative import
   time of orjson and of json. Alone, orjson imports dataclasses, inspect,
   uuid and json; a worker imports most of those anyway, so the figure that
   counts is orjson's share of a worker's imports as it starts: the time to
   import orjson in a fresh interpreter that imported every module other
   than the project's own that a starting worker has, against that
   worker's whole import time.
2. Documents pjrt-pool writes: a bundle index of 2,000 programs and a
   manifest of as many, as bytes; parse_json (the parse and its depth walk)
   against json.loads of the same bytes.
3. Hostile text at the readers' bounds (1 MiB: an entry header or a memo;
   64 MiB: a bundle index): parse_json's time to refuse each, against
   json.loads of a valid document of the same size.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
from collections.abc import Callable

from harness import Side, compare, ratio_line, report

from worker.untrusted import MAX_JSON_DEPTH, parse_json

_IMPORT = re.compile(r"import time:\s+\d+ \|\s+(\d+) \|\s*(\S+)$")


def import_seconds(module: str) -> float:
    """The cumulative time of importing module in a fresh interpreter (-X importtime)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"],
        capture_output=True,
        text=True,
        check=True,
    )
    for line in done.stderr.splitlines():
        found = _IMPORT.search(line)
        if found and found.group(2) == module:
            return int(found.group(1)) / 1e6
    raise RuntimeError(f"no import time for {module}")


_WORKER_MODULES = "worker.plugin.startup, worker.serve.start"
"""What a worker process imports as it starts (worker/__main__.py), orjson among them."""

_WORKER_IMPORT = f"""
import sys, time
start = time.perf_counter()
import {_WORKER_MODULES}
print(time.perf_counter() - start)
# Not the project's own modules: importing one of them imports orjson.
print(" ".join(sorted(n for n in sys.modules if n.split(".")[0] not in ("orjson", "worker"))))
"""

_ORJSON_AFTER = """
import importlib, sys, time
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:
        pass
start = time.perf_counter()
import orjson
print(time.perf_counter() - start)
"""


def worker_import_seconds() -> dict[str, float]:
    """A worker's imports as it starts ("wall"), and orjson's share of them ("orjson": the
    time to import it after all the others)."""
    done = subprocess.run(
        [sys.executable, "-c", _WORKER_IMPORT], capture_output=True, text=True, check=True
    )
    total, modules = done.stdout.splitlines()
    alone = subprocess.run(
        [sys.executable, "-c", _ORJSON_AFTER, *modules.split()],
        capture_output=True,
        text=True,
        check=True,
    )
    return {"wall": float(total), "orjson": float(alone.stdout)}


def refusing(function: Callable[[], object]) -> Callable[[], None]:
    """A side's call: function(), which may refuse its text (ValueError)."""

    def measure() -> None:
        with contextlib.suppress(ValueError):  # the hostile texts are refused
            function()

    return measure


def index_document(programs: int) -> bytes:
    entries = {}
    specs = []
    for i in range(programs):
        key = f"{i:064x}"
        specs.append(
            {
                "name": f"program_{i}",
                "platform": "cpu",
                "key": key,
                "input_types": [["float32", [128, 64]], ["int32", [128]]],
                "output_types": [["float32", [128, 10]]],
                "output_bytes": 5120,
            }
        )
        entries[key] = {"program_sha256": key, "size": 123456, "environment": "a" * 16}
    document = {"format": 1, "kind": "pjrt-pool-bundle", "programs": specs, "entries": entries}
    return json.dumps(document, sort_keys=True, indent=1).encode()


def hostile(size: int) -> dict[str, bytes]:
    hidden = '["\u0122", ' + "[" * (size // 4 - 8) + "]" * (size // 4 - 8) + ', "\u0122"]'
    return {
        "escaped quotes": (b"[" * (MAX_JSON_DEPTH + 1) + b'"' + b'\\"' * size)[:size],
        "brackets": b"[" * size,
        "UTF-16 nesting": hidden.encode("utf-16-le"),
        "1000 levels, padded": b"[" * 1000 + b" " * (size - 2000) + b"]" * 1000,
    }


def valid_of_size(size: int) -> bytes:
    item = b'{"name": "x", "shape": [1, 2, 3], "value": 1.5},'
    count = max(1, size // len(item))
    return b"[" + item * (count - 1) + item[:-1] + b"]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    rounds = parser.parse_args().rounds

    imports = [Side(m, lambda m=m: import_seconds(m), measures=True) for m in ("json", "orjson")]
    report(compare(imports, rounds, warmup=0), "import in a fresh interpreter (cumulative)")
    starting = compare([Side("worker start", worker_import_seconds, True)], rounds, warmup=0)
    print("a worker's imports as it starts, and orjson's share (imported after the others)")
    whole = starting.median("worker start")
    ratio_line("a worker's imports", whole, whole)
    ratio_line("orjson's share", starting.median("worker start", "orjson"), whole)

    index = index_document(2000)
    documents = [
        Side("json.loads", lambda: json.loads(index)),
        Side("parse_json", lambda: parse_json(index)),
    ]
    report(compare(documents, 5), f"a bundle index of 2000 programs ({len(index) / 1e6:.1f} MB)")

    for size in (1 << 20, 64 << 20):
        valid = valid_of_size(size)
        sides = [Side("json.loads of valid JSON that size", lambda v=valid: json.loads(v))]
        sides += [
            Side(f"parse_json refusing {label}", refusing(lambda d=data: parse_json(d)))
            for label, data in hostile(size).items()
        ]
        report(compare(sides, 3), f"hostile text of {size >> 20} MiB")


if __name__ == "__main__":
    main()
