"""Benchmark: parse_json (orjson) against json.loads, and what importing orjson costs.

Usage::

    python benchmarks/bench_json.py [--rounds N]

Three measures, each against a baseline taken in the same run:

1. Import: fresh interpreters (``python -X importtime -c "import M"``),
   --rounds times each, interleaved; the medians of the cumulative import
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
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from worker.untrusted import MAX_JSON_DEPTH, parse_json

_IMPORT = re.compile(r"import time:\s+\d+ \|\s+(\d+) \|\s*(\S+)$")


def import_microseconds(module: str) -> int:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"],
        capture_output=True,
        text=True,
        check=True,
    )
    for line in done.stderr.splitlines():
        found = _IMPORT.search(line)
        if found and found.group(2) == module:
            return int(found.group(1))
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


def worker_import_seconds() -> tuple[float, float]:
    """(a worker's imports as it starts, orjson's share: importing it after all the others)."""
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
    return float(total), float(alone.stdout)


def best_seconds(function: Callable[[], object], rounds: int) -> float:
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        with contextlib.suppress(ValueError):  # the hostile texts are refused
            function()
        seconds.append(time.perf_counter() - start)
    return min(seconds)


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

    samples: dict[str, list[int]] = {"json": [], "orjson": []}
    for _ in range(rounds):
        for module in samples:
            samples[module].append(import_microseconds(module))
    imports = {module: statistics.median(values) for module, values in samples.items()}
    print(f"import, median of {rounds} fresh interpreters (cumulative, -X importtime):")
    for module, value in imports.items():
        print(f"  {module:8} {value / 1000:7.2f} ms")
    print(f"  orjson / json: {imports['orjson'] / imports['json']:.2f}x")
    shares = [worker_import_seconds() for _ in range(rounds)]
    total = statistics.median(t for t, _ in shares)
    share = statistics.median(o for _, o in shares)
    print(
        f"  a worker's imports as it starts: {total * 1000:.1f} ms, of which orjson (imported "
        f"after the others) {share * 1000:.2f} ms: {share / total:.3f}x"
    )

    print("\ndocuments pjrt-pool writes (best of 5):")
    for label, data in (("index, 2000 programs", index_document(2000)),):
        ours = best_seconds(lambda data=data: parse_json(data), 5)
        theirs = best_seconds(lambda data=data: json.loads(data), 5)
        print(
            f"  {label} ({len(data) / 1e6:.1f} MB): parse_json {ours * 1000:.1f} ms, "
            f"json.loads {theirs * 1000:.1f} ms, ratio {ours / theirs:.2f}x"
        )

    print("\nhostile text at the bounds (best of 3), against json.loads of valid JSON that size:")
    for size in (1 << 20, 64 << 20):
        valid = valid_of_size(size)
        baseline = best_seconds(lambda valid=valid: json.loads(valid), 3)
        print(f"  {size >> 20} MiB: json.loads of a valid document {baseline * 1000:.1f} ms")
        for label, data in hostile(size).items():
            ours = best_seconds(lambda data=data: parse_json(data), 3)
            print(f"    {label:20} parse_json {ours * 1000:8.2f} ms  ({ours / baseline:.3f}x)")


if __name__ == "__main__":
    main()
