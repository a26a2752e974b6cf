"""``pjrt-pool check-plugin``: does a PJRT plugin compute what JAX computes?

Runs the built-in battery of small programs (elementwise math, comparisons,
integer ops, conversions, reductions, dot and convolution, gather and
scatter, sorting, FFT, control flow, random numbers, linear algebra) on the
plugin in worker processes and compares each result with jax.jit in this
process. A crash or hang fails its case only. The programs are those
lower() writes, with its workarounds for plugin builds known to miscompile
something (--no-workarounds: without). Results are remembered per plugin
build in the cache directory, and later processes that load a build with
failing cases warn about them. The report also counts the cases whose
outputs are jax.jit's bit for bit, and says where the plugin is another
build of XLA than jax.jit's (--exact: a case that is not bit for bit fails).
Exit status: 0 when every case passes
(skipped cases do not fail), 1 when any is wrong, errs, crashes or hangs
(or the plugin crashes as it starts; with --exact, or is not bit for bit),
2 for usage and environment errors (no plugin, or a file that is not one).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from pool.cli import interrupts
from pool.cli.main import CommandError, ExitCode, UsageError
from pool.cli.options import (
    add_command,
    add_pool_option,
    paragraph,
    pool_option,
)
from pool.cli.paths import checked_cache_dir
from pool.progress import ProgressDisplay
from worker.plugin.platforms.registry import platform_named
from worker.plugin.runtime import default_platform


def register(subparsers: Any) -> None:
    """Adds the ``check-plugin`` command."""
    check = add_command(
        subparsers,
        "check-plugin",
        _check,
        "compare a PJRT plugin's results with JAX's on a battery of small programs",
        paragraph(__doc__, 1),
    )
    add_pool_option(check, "platform", "platform to check")
    check.add_argument(
        "--plugin",
        metavar="PATH",
        default=None,
        help="plugin library to check (default: the platform's plugin, see PJRT_POOL_PLUGIN_*)",
    )
    add_pool_option(check, "workers", "worker processes (default: one per CPU)")
    check.add_argument(
        "--cases",
        metavar="PATTERN",
        action="append",
        default=None,
        help="run the cases matching PATTERN (shell wildcards; a prefix selects what is below "
        "it; comma-separated or repeated), e.g. 'elementwise/arctan' or '*/float16/*'",
    )
    add_pool_option(
        check,
        "task_timeout",
        "per-case limit in a worker, and for jax.jit's side (there at least 10 s; default 60)",
    )
    add_pool_option(check, "cache_dir", "cache directory, where results are remembered")
    check.add_argument(
        "--no-workarounds",
        dest="workarounds",
        action="store_false",
        help="run the programs as JAX writes them, without the workarounds lower() applies for "
        "plugin builds known to miscompile something: shows the plugin's own bugs (not "
        "remembered)",
    )
    check.add_argument(
        "--exact",
        action="store_true",
        help="fail on every case whose outputs are not jax.jit's bit for bit, even within its "
        "error budget, and list them (the report counts them either way)",
    )
    check.add_argument("--list", action="store_true", help="list the selected cases and exit")
    check.add_argument("--json", action="store_true", help="print the report as JSON on stdout")


def _patterns(values: list[str] | None) -> list[str] | None:
    if not values:
        return None
    return [p.strip() for value in values for p in value.split(",") if p.strip()]


def _check(args: argparse.Namespace) -> int:
    pool_option(args, "workers")  # before importing JAX: answers at once
    pool_option(args, "task_timeout")
    checked_cache_dir(args.cache_dir)
    checked = platform_named(args.platform or default_platform())
    if "cpu" in checked.jax_names and not os.environ.get("JAX_PLATFORMS"):
        # JAX's side runs on the CPU (here, and in the reference process, which inherits
        # this): JAX then never loads libtpu where the tpu extra installed it, whose start on
        # a machine without a TPU logs "E0000 ... unexpected worker hostname" (docs).
        os.environ["JAX_PLATFORMS"] = "cpu"
    with interrupts.at_once():  # JAX's import: nothing held yet (pool.cli.interrupts)
        # Here, not at the top: the battery imports JAX (about a second), which
        # `pjrt-pool --help` and a usage error should not wait for.
        from pool.conformance import (
            CheckError,
            PluginStartError,
            format_report,
            remember,
            report_json,
            run_cases,
        )
        from pool.conformance.battery import select

    try:
        cases = select(_patterns(args.cases))
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.list:
        for case in cases:
            print(f"{case.name}  (budget {case.budget.ulps:g} ULP{', x64' if case.x64 else ''})")
        return ExitCode.OK
    progress = ProgressDisplay(len(cases)) if sys.stderr.isatty() else None
    options = {} if args.timeout is None else {"timeout": args.timeout}
    try:
        report = run_cases(
            cases,
            platform=args.platform,
            plugin=args.plugin,
            workers=args.workers,
            cache_dir=args.cache_dir,
            on_result=None
            if progress is None
            else lambda r: progress.update(r.name, r.status, r.seconds),
            workarounds=args.workarounds,
            exact=args.exact,
            # Cases chosen by name run even where their types are unsupported.
            run_unsupported=args.cases is not None,
            **options,
        )
    except PluginStartError as error:
        # A plugin that crashes as it starts has a problem (1); a file that is no
        # plugin at all is this machine's set-up, an environment error (pool.cli.main).
        raise CommandError(str(error)) from error
    except CheckError as error:
        raise UsageError(str(error)) from None
    finally:
        if progress is not None:
            progress.close()
    memo = remember(report, args.cache_dir)
    if args.json:
        print(report_json(report))
    else:
        print(format_report(report))
        if memo is not None:
            print(f"results remembered for this plugin build in {memo}")
        elif report.workarounds_off:
            print("results not remembered: checked without the workarounds lower() applies")
    return ExitCode.OK if report.ok else ExitCode.PROBLEMS
