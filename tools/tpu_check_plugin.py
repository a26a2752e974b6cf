"""check-plugin on a TPU host as a user runs it, and its plugin side rehearsed without a chip.

Usage::

    python tools/tpu_check_plugin.py --out DIR [--forced]       # on a TPU VM
    python tools/tpu_check_plugin.py --deviceless [--topology v5e:1x1] [--workers N]

On the chip: runs ``pjrt-pool check-plugin --platform tpu`` with no other
option, in a process of its own with JAX_PLATFORMS unset (as a user's shell
has it), its report saved as DIR/check-plugin.txt (stdout) and
DIR/check-plugin.err; then prints the lines that say what became of the
types and the reference side, the summary table and the verdict, the wall
time against the 10 minutes it must stay within, and the share of the
supported cases that pass. --forced also runs ``--cases
convert/int32/to_float/n256``, a case that needs complex128: chosen by
name, it runs though libtpu does not compile that type (DIR/forced.txt).

--deviceless rehearses the plugin's side on any machine with libtpu: every
case of the battery lowered for TPU and, once the element types it uses
are probed as the check probes them, compiled for the topology (default
v5e:1x1) in a compile-only pool with the check's 60 s limit; prints the
types refused, how many cases compile, fail, crash or hang, each failure in
a line, and the wall time.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import subprocess
import sys
import time
from pathlib import Path

GOAL_SECONDS = 600.0
"""The whole battery must finish within 10 minutes on a one-chip v5e host."""
FORCED = "convert/int32/to_float/n256"
CLI = (sys.executable, "-c", "import sys; from pool.cli.main import main; sys.exit(main())")
"""The pjrt-pool console script's code (python -m pool.cli.main would import the module twice,
as __main__ and as itself, and its errors would miss its handler)."""


def _check(out: Path, *options: str, name: str) -> tuple[int, float, str]:
    """Runs check-plugin --platform tpu with the options; (exit, seconds, report)."""
    environment = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    command = [*CLI, "check-plugin", "--platform", "tpu"]
    started = time.perf_counter()
    done = subprocess.run(
        [*command, *options], capture_output=True, text=True, env=environment, check=False
    )
    seconds = time.perf_counter() - started
    (out / f"{name}.txt").write_text(done.stdout)
    (out / f"{name}.err").write_text(done.stderr)
    return done.returncode, seconds, done.stdout


def on_the_chip(out: Path, forced: bool) -> None:
    """The check as a user runs it (see the module)."""
    out.mkdir(parents=True, exist_ok=True)
    code, seconds, report = _check(out, name="check-plugin")
    lines = report.splitlines()
    said = [
        line
        for line in lines
        if line.startswith(("plugin:", "reference:", "types:", "unsupported here:"))
    ]
    table = lines[next((i for i, line in enumerate(lines) if line.startswith("family")), 0) :]
    print("\n".join([*said, "", *table]))
    totals = next((line.split() for line in table if line.startswith("total")), [])
    if totals:
        columns = table[0].split()[2:]
        counts = dict(zip(columns, map(int, totals[2:]), strict=False))
        supported = int(totals[1]) - counts.get("unsupported", 0) - counts.get("skipped", 0)
        share = counts.get("pass", 0) / supported if supported else 0.0
        print(
            f"\nexit {code}; {seconds:.0f} s ({'within' if seconds <= GOAL_SECONDS else 'OVER'} "
            f"the {GOAL_SECONDS:.0f} s goal); {counts.get('pass', 0)} of {supported} supported "
            f"cases pass ({100 * share:.1f}%, goal 80%); {counts.get('reference', 0)} lost to "
            "jax.jit's side"
        )
    else:
        print(f"\nexit {code} after {seconds:.0f} s, no report: see {out / 'check-plugin.err'}")
    if forced:
        code, seconds, report = _check(out, "--cases", FORCED, name="forced")
        shown = [line for line in report.splitlines() if FORCED in line or "unsupported" in line]
        print(f"\nforced ({FORCED}): exit {code} in {seconds:.0f} s")
        print("\n".join(shown))
    print(f"\nreports in {out}")


def deviceless(topology: str, workers: int) -> None:
    """The plugin's side compiled for a topology without a chip (see the module)."""
    import jax

    from pool import Pool, lower
    from pool.conformance import battery
    from pool.conformance.runner import DEFAULT_TIMEOUT, describe_failure
    from pool.conformance.type_probe import TypeProbe, element_types

    started = time.perf_counter()
    outcomes: dict[str, str] = {}
    with Pool(workers, platform="tpu", topology=topology, task_timeout=DEFAULT_TIMEOUT) as pool:
        probe = TypeProbe(pool, "tpu", DEFAULT_TIMEOUT, lambda error: describe_failure(error)[1])
        lowered = []
        for case in battery():
            with jax.enable_x64(case.x64):
                program = lower(case.function, case.make_inputs(), platform="tpu")
            types = element_types(program.text)
            probe.ask(types)
            lowered.append((case.name, program, types))
        compiles = {}
        for name, program, types in lowered:
            concurrent.futures.wait(probe.pending())
            refused = probe.verdict(types)
            if refused:
                outcomes[name] = "unsupported: needs " + " and ".join(t.name for t in refused)
            else:
                compiles[name] = pool.submit_compile(program, name=name)
        for name, future in compiles.items():
            error = future.exception()
            outcomes[name] = "compiles" if error is None else ": ".join(describe_failure(error)[:2])
        for support in probe.outcomes():
            if not support.supported:
                print(f"unsupported here: {support.name}: {support.why[:300]}")
    counts = collections.Counter(outcome.split(":")[0] for outcome in outcomes.values())
    for name, outcome in outcomes.items():
        if outcome != "compiles" and not outcome.startswith("unsupported"):
            print(f"{name}: {outcome[:300]}")
    seconds = time.perf_counter() - started
    print(f"{dict(counts)}; {len(outcomes)} cases in {seconds:.0f} s, {workers} compile workers")


def main() -> None:
    """Runs the check on the chip, or its deviceless rehearsal (see the module)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="where the reports go")
    parser.add_argument("--forced", action="store_true", help="also a case chosen by name")
    parser.add_argument("--deviceless", action="store_true", help="compile only, any machine")
    parser.add_argument("--topology", default="v5e:1x1")
    parser.add_argument("--workers", type=int, default=max(2, (os.cpu_count() or 1) // 3))
    args = parser.parse_args()
    if args.deviceless:
        deviceless(args.topology, args.workers)
    elif args.out is None:
        parser.error("give --out DIR (on a TPU host), or --deviceless")
    else:
        on_the_chip(args.out, args.forced)


if __name__ == "__main__":
    main()
