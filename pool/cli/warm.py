"""``pjrt-pool warm SPEC`` and ``pjrt-pool run MANIFEST NAME``.

warm lowers and compiles every program of a spec into the disk cache with a
pool of workers, shows progress, prints a report (``--json`` for scripts) and
writes a manifest (``--manifest FILE``). Exit status: 0 when every program
is in the cache, 1 when any failed (lowering error, compile error, worker
crash, timeout) or was skipped, 2 for usage errors, specs that do not load
and programs that need more devices than a worker holds (setup error), 130
after a Ctrl-C and 143 after SIGTERM, each of which reports what was warmed
and writes the manifest of those programs. A manifest that does not name
every program of the spec is marked partial (bundle create refuses it
without --allow-partial), and never replaces a complete one.

run loads one program of a manifest from the warm cache (or of a bundle,
from the bundle itself, writing nothing) and runs it, on inputs from an .npz
file (or an .npy file of its one input) or on seeded random inputs,
printing its outputs' types and checksums and how long loading and running
took; with --scheduler it runs on a Dask cluster, with --ray on a Ray cluster,
once or once per --batch file (pool.cli.cluster_run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pool.cli import interrupts
from pool.cli.jax_cache_options import (
    add_jax_cache_options,
    check_jax_version,
    jax_cache_option,
)
from pool.cli.main import CommandError, ExitCode, UsageError
from pool.cli.options import (
    add_cluster_options,
    add_command,
    add_pool_option,
    add_remote_option,
    add_topology_options,
    check_cluster,
    cluster_address,
    open_remote_option,
    pool_option,
    remote_url,
    topology_option,
)
from pool.cli.paths import checked_cache_dir, checked_manifest_cache_dir, manifest_or_bundle_file
from pool.cli.run_files import describe, finite_sums, read_inputs
from pool.manifest import (
    BundleRefusedError,
    Manifest,
    ManifestError,
    is_bundle,
    kind_of,
    load_manifest,
)
from pool.progress import ProgressDisplay
from worker.compile.arguments import random_inputs
from worker.compile.never_compile import never_compile_on
from worker.errors import BundleError, NotInCacheError, PjrtError, PluginNotFoundError
from worker.partitioning import devices_needed
from worker.plugin.locate import find_plugin
from worker.plugin.runtime import default_platform

if TYPE_CHECKING:
    from pool.warm.report import ProgramReport, WarmReport
    from worker.records import ProgramSpec


def register(subparsers: Any) -> None:
    """Adds the ``warm`` and ``run`` commands."""
    _register_warm(subparsers)
    _register_run(subparsers)


def _register_warm(subparsers: Any) -> None:
    warm = add_command(
        subparsers,
        "warm",
        _warm,
        "compile a spec's programs into the disk cache, with a report and a manifest",
        "Lowers every program of a spec and compiles it into the disk cache with a pool of "
        "workers, showing progress; prints a report (--json for scripts) and writes a manifest "
        "of the programs warmed (--manifest FILE), which run and bundle create take.",
        epilog="exit status: 0 when every program is in the cache; 1 when any failed "
        "(lowering error, compile error, worker crash, timeout, not stored, not warmed) or was "
        "skipped; 2 for usage and environment errors, specs that do not load, and programs "
        "that need more devices than a worker holds (setup error); 130 after a Ctrl-C and 143 "
        "after SIGTERM, which report what was warmed and write the manifest of those programs. "
        "A manifest that leaves programs out is marked partial, and never replaces a complete "
        "one.",
    )
    warm.add_argument(
        "spec",
        metavar="SPEC",
        help="spec.py (its programs() lists the programs), spec.py:function or module:function",
    )
    add_pool_option(warm, "workers", "compile workers (default: one per CPU)")
    warm.add_argument(
        "--lower-workers",
        type=int,
        default=0,
        metavar="N",
        help="lower in N extra processes (default 0: in this process, overlapped with compiling)",
    )
    add_pool_option(warm, "platform", "platform to compile for")
    add_topology_options(
        warm,
        "compile for this TPU topology, without its devices: on a machine without one, or beside "
        "the process that holds the chip (with --scheduler or --ray, on every node)",
    )
    add_pool_option(
        warm,
        "devices_per_worker",
        "devices each compile worker holds, for programs over several devices (default: on "
        "the CPU, as many as the largest mesh the spec's shardings name, else 1; a topology's "
        "programs compile without any)",
    )
    add_pool_option(warm, "cache_dir", "cache directory, made if missing")
    add_pool_option(warm, "task_timeout", "per-program compile timeout (default: none)")
    mode = warm.add_mutually_exclusive_group()
    mode.add_argument(
        "--keep-going",
        dest="fail_fast",
        action="store_false",
        default=False,
        help="record failures and warm the rest (the default)",
    )
    mode.add_argument(
        "--fail-fast", dest="fail_fast", action="store_true", help="stop at the first failure"
    )
    add_cluster_options(warm, "compile on")
    add_remote_option(
        warm,
        "a remote cache tier: entries are prefetched from it before compiling, and what is "
        "compiled is published to it",
    )
    warm.add_argument(
        "--json",
        action="store_true",
        help="print the report as JSON on stdout (alone there: what the spec prints goes to "
        "stderr)",
    )
    warm.add_argument(
        "--manifest",
        metavar="FILE",
        help="write a manifest of the warmed programs (checked before warming: its directory "
        "must exist and be writable)",
    )
    add_jax_cache_options(
        warm,
        "make each program's entry of JAX's persistent cache",
        "write the entries into the JAX cache directory DIR (made if missing)",
    )


def _register_run(subparsers: Any) -> None:
    run = add_command(
        subparsers,
        "run",
        _run,
        "run one program of a manifest from the warm cache, or of a bundle",
        "Loads one program of a manifest from the warm cache, or of a bundle from the bundle "
        "itself (writing nothing), and runs it on the inputs of --inputs or on seeded random "
        "inputs of its input types; prints how long loading and running took and each output's "
        "dtype, shape and sum. With --workers it runs through a Pool, with --scheduler on a "
        "Dask cluster or --ray on a Ray cluster, once or once per --batch file. Without NAME, "
        "lists the programs (as JSON with --json).",
        epilog="exit status: 0 when the program ran (with --batch: every run); 1 when the "
        "bundle or the program's entry was refused (damaged, cut short, or changed after the "
        "bundle was made, as bundle check and import refuse it), the plugin failed to load or "
        "run it, or a --batch run failed; 2 for usage and environment errors, among them a "
        "program whose key is not in the cache and options for running given without NAME; "
        "130 after a Ctrl-C, 143 after SIGTERM.",
        exit_at_once=True,
    )
    run.add_argument(
        "manifest", metavar="MANIFEST", help="a manifest, or a bundle (a file or its URL)"
    )
    run.add_argument(
        "name",
        metavar="NAME",
        nargs="?",
        help="the program to run (default: list the programs, with their types)",
    )
    run.add_argument(
        "--inputs",
        metavar="FILE",
        help="an .npz file with arr_0, arr_1, ... as the inputs, or an .npy file of a program's "
        "one input (pool.save_inputs writes one); without it, seeded random inputs",
    )
    run.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="N",
        help="seed of the random inputs (default 0)",
    )
    add_pool_option(run, "cache_dir", "cache directory", default="the manifest's")
    add_pool_option(
        run,
        "workers",
        "run through a Pool of N workers, which load from the cache or the bundle "
        "(default: in this process)",
    )
    add_remote_option(
        run,
        "for a manifest: the remote cache tier, from which an entry the cache lacks is "
        "fetched (verified) into the cache",
    )
    run.add_argument(
        "--prime",
        action="store_true",
        help="prime the program (run it twice on zeros) as it loads, timed with loading, so "
        "that the timed run is at the warm speed",
    )
    add_cluster_options(run, "run on", "each node loading the program from its cache")
    run.add_argument(
        "--batch",
        metavar="FILE",
        nargs="+",
        default=None,
        help="with --scheduler or --ray: run once per .npz (or .npy) file, with progress and "
        "a report",
    )
    run.add_argument(
        "--json",
        action="store_true",
        help="print the result as JSON (an output's sum that is not finite is null: JSON has "
        "no NaN)",
    )


def _check_warm_arguments(args: argparse.Namespace) -> None:
    """Refuses bad arguments before anything slow starts; raises UsageError."""
    pool_option(args, "workers")
    if args.devices_per_worker is not None:  # else as many as the spec's meshes (warm())
        args.devices_per_worker = pool_option(args, "devices_per_worker")
    if args.lower_workers < 0:
        raise UsageError(
            f"--lower-workers must be 0 (lower in this process) or more, not {args.lower_workers}"
        )
    if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
        raise UsageError(
            f"--timeout must be a positive number of seconds, not {args.timeout:g}; "
            "leave it out for no timeout"
        )
    if args.manifest:
        _check_manifest_path(Path(args.manifest))
    topology_option(args)  # UsageError for a name libtpu would not take
    _check_jax_cache_arguments(args)
    if cluster_address(args) is None:  # a cluster's nodes have their own plugins, caches...
        open_remote_option(args.remote)  # UsageError for a URL or setting the tier cannot use
        checked_cache_dir(args.cache_dir, create=True)
        _check_plugin(args.platform or default_platform(), "--platform")
    else:
        check_cluster(args)  # MissingExtraError or UsageError: exit 2
        remote_url(args.remote)  # UsageError for a URL the remote tier cannot use


def _check_jax_cache_arguments(args: argparse.Namespace) -> None:
    """Refuses what a warm for JAX's cache cannot do, before anything imports JAX."""
    given = [
        name
        for name, value in (
            ("--jax-cache-path", args.jax_cache_path),
            ("--libtpu-init-args", args.libtpu_init_args),
        )
        if value is not None
    ]
    if args.jax_cache is None:
        if given:
            raise UsageError(f"{', '.join(given)} describe JAX's cache: give --jax-cache too")
        return
    if args.manifest:
        raise UsageError(
            "--manifest lists programs pjrt-pool runs; JAX cache entries are JAX's own: "
            "leave --manifest out with --jax-cache"
        )
    platform = args.platform or default_platform()
    if platform not in ("cpu", "tpu"):
        raise UsageError(
            f"--jax-cache makes entries for the CPU and TPU topologies, not {platform}"
        )
    if platform == "tpu" and args.topology is None:
        raise UsageError(
            "--jax-cache for a TPU names the topology its JAX sees: --topology v5e:1x1"
        )
    if args.jax_cpu_devices < 1:
        raise UsageError(f"--jax-cpu-devices must be 1 or more, not {args.jax_cpu_devices}")


def _jax_cache_said(args: argparse.Namespace, report: WarmReport) -> str:
    """Where the JAX cache entries went, and for which target."""
    made = sum(1 for p in report.programs if p.outcome.ok and p.jax_key is not None)
    destination = jax_cache_option(args)
    assert destination is not None
    target = destination.target
    where = (
        f"in {destination.directory}"
        if destination.directory is not None
        else "in pjrt-pool's stores (for install())"
    )
    return (
        f"JAX cache: {made} entr{'y' if made == 1 else 'ies'} {where}, for {target.describe()} "
        f"with jax_compilation_cache_dir={target.cache_path}, {target.compression.value}"
    )


def _check_manifest_path(path: Path) -> None:
    """Warming can take hours: a manifest that cannot be written is refused first."""
    if path.is_dir():
        raise UsageError(f"--manifest {path} is a directory; name a file to write, such as m.json")
    folder = path.parent
    if not folder.is_dir():
        raise UsageError(
            f"--manifest {path}: the directory {folder} does not exist; create it first "
            "or name a file in an existing directory"
        )
    if not os.access(folder, os.W_OK):
        raise UsageError(f"--manifest {path}: cannot write in {folder}; name another place")


def _check_plugin(platform: str, option: str) -> None:
    try:
        find_plugin(platform)
    except PluginNotFoundError as error:
        raise UsageError(f"{option} {platform}: {error}") from None


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Sends whatever is written to stdout meanwhile to stderr, at the descriptor.

    A spec's imports and functions may print (``import brax.envs`` does), and
    so may the processes started meanwhile (lowering workers, which inherit
    the descriptor): stdout is the report's alone, so that ``--json`` output
    parses.
    """
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _compile_mode() -> None:
    """Raises UsageError for a PJRT_POOL_COMPILE that is neither never nor allow."""
    try:
        never_compile_on()
    except ValueError as error:
        raise UsageError(str(error)) from None


def _warm(args: argparse.Namespace) -> int:
    _compile_mode()
    _check_warm_arguments(args)  # before importing JAX: a usage error answers at once
    with interrupts.at_once():  # JAX's import, and the user's spec: nothing held yet
        # Here, not at the top: warming imports JAX (about a second), and the spec
        # loader is of no use to `pjrt-pool run`, which this module also serves.
        from pool.warm.report import WarmInterrupted, report_json
        from pool.warm.spec_file import SpecError, load_spec
        from pool.warm.warming import warm

        with _stdout_to_stderr():
            try:
                spec = load_spec(args.spec)
            except SpecError as error:
                raise UsageError(str(error)) from None
    if args.jax_cache is not None:
        check_jax_version()
    interrupted: WarmInterrupted | None = None
    # The report and manifest are written whatever signal comes once warming has begun
    # (pool.cli.interrupts): SIGINT and SIGTERM alike stop the warming, then wait.
    with interrupts.held():
        with _stdout_to_stderr():
            progress = ProgressDisplay(len(spec.programs))
            try:
                with interrupts.unwinding():
                    report = warm(
                        spec,
                        workers=args.workers,
                        # Named: this command's JAX is on the CPU (pool.cli.main), so
                        # JAX's default device would not say what the workers load.
                        platform=args.platform or default_platform(),
                        cache_dir=args.cache_dir,
                        timeout=args.timeout,
                        fail_fast=args.fail_fast,
                        lower_workers=args.lower_workers,
                        progress=progress,
                        scheduler=args.scheduler,
                        ray=args.ray,
                        remote=args.remote,
                        topology=topology_option(args),
                        devices_per_worker=args.devices_per_worker,
                        jax_cache=jax_cache_option(args),
                    )
            except WarmInterrupted as stopped:  # reported and written as far as it got
                report, interrupted = stopped.report, stopped
        written = _write_manifest(args, report) if args.manifest else None
        if args.json:
            print(report_json(report))
        else:
            print(report.summary())
            if written is not None:
                print(written)
            if args.jax_cache is not None:
                print(_jax_cache_said(args, report))
    if interrupted is not None:
        raise interrupts.Reported() from interrupted
    return report.exit_code


def _write_manifest(args: argparse.Namespace, report: WarmReport) -> str:
    """Writes --manifest of the programs warmed, marked partial unless every program of the
    spec was; returns what to say. A partial one never replaces a complete manifest."""
    cache_dir = str(Path(args.cache_dir).resolve()) if args.cache_dir else None
    specs = [p.spec for p in report.programs if p.spec is not None and p.outcome.ok]
    if not specs:
        return f"manifest: none written (no program was warmed); {args.manifest} is as it was"
    warmed = f"the {len(specs)} of {len(report.programs)} programs warmed"
    if not report.ok and _complete_manifest(args.manifest):
        return (
            f"manifest: {args.manifest} kept as it was: it is a complete manifest, and this "
            f"warm gives only {warmed}; warm again once every program warms, or name another "
            "file"
        )
    missing = {p.name: _why(p) for p in report.programs if not p.outcome.ok}
    platform = args.platform or specs[0].platform
    manifest = Manifest(specs, cache_dir, platform, partial=not report.ok, missing=missing)
    manifest.write(args.manifest)
    if report.interrupted:
        return f"manifest: {args.manifest}, partial: {warmed} before the interrupt"
    if not report.ok:
        return f"manifest: {args.manifest}, partial: {warmed} (the others failed, as said above)"
    return f"manifest: {args.manifest}"


def _complete_manifest(path: str) -> bool:
    """Whether a file holds a manifest that is not partial (one that does not read is not)."""
    try:
        return not load_manifest(path).partial
    except ManifestError:
        return False


def _why(program: ProgramReport) -> str:
    """What happened to a program a partial manifest leaves out, in one line."""
    first = (program.error or "").strip().splitlines()
    return f"{program.outcome.value}: {first[0]}" if first else program.outcome.value


def _inputs(args: argparse.Namespace, spec: Any) -> list[np.ndarray]:
    """The program's inputs from --inputs, or seeded random ones; checked against its types."""
    if not args.inputs:
        if spec.input_types is None:
            raise UsageError(f"{spec.name} has unknown input types: give --inputs")
        return random_inputs(spec.input_types, args.seed)
    return read_inputs(args.inputs, spec, "--inputs")


def _not_in_cache(name: str, error: Exception, from_bundle: bool) -> UsageError:
    if from_bundle:
        return UsageError(f"{name}: {error}")
    return UsageError(
        f"{name}: {error} (if it was warmed into another directory, pass that as --cache-dir)"
    )


def _run(args: argparse.Namespace) -> int:
    # A pool's workers and shared memory are cleaned up at exit: only a run in this
    # process ends without the plugin's teardown (pool.cli.main.exit_at_once).
    args.exit_at_once = not args.workers and not cluster_address(args)
    _check_run_options(args)
    if not args.exit_at_once:
        return _run_program(args)
    with interrupts.at_once():  # in this process, reading only: nothing held to undo
        return _run_program(args)


def _run_program(args: argparse.Namespace) -> int:
    _compile_mode()  # a run compiles nothing, but a bad setting is the user's to know
    manifest_or_bundle_file(args.manifest)
    # A bundle carries its executables: only an explicit --remote is checked (and refused).
    remote = remote_url(args.remote) if args.remote or not is_bundle(args.manifest) else None
    if remote is not None and not cluster_address(args):  # else the nodes', their settings
        open_remote_option(remote)  # UsageError for a setting the tier cannot use
    try:
        manifest = load_manifest(args.manifest, args.cache_dir, prime=args.prime, remote=remote)
        if args.name is None:
            _list_programs(args, manifest)
            return ExitCode.OK
        spec = manifest.spec(args.name)
    except BundleRefusedError as error:  # damaged: 1, as bundle check and import say it
        raise CommandError(str(error)) from None
    except ManifestError as error:
        raise UsageError(str(error)) from None
    if args.batch and not cluster_address(args):
        raise UsageError(
            "--batch runs on a cluster: give --scheduler ADDRESS or --ray ADDRESS (or local:N)"
        )
    if args.batch and args.inputs:
        raise UsageError("--batch names the inputs of each run: leave --inputs out")
    if args.batch and manifest.bundle is not None:
        raise UsageError(
            "--batch runs a manifest's program from the nodes' caches: import the bundle there "
            "(pjrt-pool bundle import FILE --manifest HOST.json) and give that manifest"
        )
    if cluster_address(args):  # the cluster's nodes have their own plugins
        if args.batch:
            from pool.cli.cluster_run import run_batch

            return run_batch(args, manifest, spec, remote)
    else:
        if manifest.bundle is None:
            checked_manifest_cache_dir(manifest.cache_dir, args.cache_dir, args.manifest)
        _check_plugin(spec.platform, f"the {kind_of(args.manifest)}'s platform")
    outputs, load_seconds, run_seconds = _timed_run(args, manifest, spec, remote)
    _report_run(args, manifest, outputs, load_seconds, run_seconds)
    return ExitCode.OK if outputs is not None else ExitCode.PROBLEMS


def _list_programs(args: argparse.Namespace, manifest: Manifest) -> None:
    """run without NAME: each program with its types (as JSON with --json)."""
    listed = [
        (name, list(map(str, spec.input_types or ())), list(map(str, spec.output_types)))
        for name, spec in manifest.specs.items()
    ]
    if args.json:
        fields = ("name", "input_types", "output_types")
        print(json.dumps([dict(zip(fields, item, strict=True)) for item in listed], indent=2))
        return
    for name, inputs, outputs in listed:
        print(f"{name}({', '.join(inputs)}) -> {', '.join(outputs)}")


def _check_run_options(args: argparse.Namespace) -> None:
    if args.name is None:
        running = {
            "--inputs": args.inputs,
            "--seed": args.seed != 0,
            "--workers": args.workers,
            "--prime": args.prime,
            "--scheduler": args.scheduler,
            "--ray": args.ray,
            "--batch": args.batch,
        }
        given = [flag for flag, value in running.items() if value]
        if given:
            raise UsageError(
                f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for running a "
                "program: name the program to run (pjrt-pool run MANIFEST NAME); without NAME, "
                "run lists the programs"
            )
    check_cluster(args)  # MissingExtraError or UsageError: exit 2
    if args.workers is not None and args.workers < 0:
        raise UsageError(
            f"--workers must be 0 (run in this process) or a number of workers, not {args.workers}"
        )
    if args.prime and (args.workers or cluster_address(args)):
        raise UsageError(
            "--prime primes the program in this process: leave out --workers, --scheduler and "
            "--ray to use it"
        )


def _timed_run(
    args: argparse.Namespace, manifest: Manifest, spec: ProgramSpec, remote: str | None
) -> tuple[Any, float, float]:
    """Loads and runs the program (on the cluster, in a pool or here); returns its outputs,
    the seconds loading took (with the cluster's or the pool's start) and the run's."""
    if cluster_address(args):
        from pool.cli.cluster_run import cluster_pool
    inputs = _inputs(args, spec)
    started = time.perf_counter()
    try:
        if cluster_address(args):
            with cluster_pool(args, manifest, spec, remote) as cluster:
                ready = time.perf_counter()
                outputs = manifest.run(args.name, inputs, pool=cluster)
                done = time.perf_counter()
        elif args.workers:
            # Here, not at the top: the Pool's machinery (subprocess, cloudpickle, the
            # wire: ~60 ms) is not needed to run in this process, the usual case.
            from pool.face import Pool

            with Pool(
                args.workers,
                platform=spec.platform,
                cache_dir=manifest.cache_dir,
                # A bundle's programs come from the bundle: the workers use no remote tier.
                remote=remote if manifest.bundle is None else False,
                devices_per_worker=devices_needed(spec.partitioning),  # what the program needs
            ) as pool:
                ready = time.perf_counter()
                outputs = manifest.run(args.name, inputs, pool=pool)
                done = time.perf_counter()
        else:
            manifest.executable(args.name)  # load from the cache, timed apart from running
            ready = time.perf_counter()
            outputs = manifest.run(args.name, inputs)
            done = time.perf_counter()
    except NotInCacheError as error:
        raise _not_in_cache(args.name, error, manifest.bundle is not None) from None
    except (BundleError, PjrtError) as error:
        # The files were refused, or the plugin failed to run them: a failed operation.
        raise CommandError(f"{args.name}: {error}") from error
    return outputs, ready - started, done - ready


def _report_run(
    args: argparse.Namespace,
    manifest: Manifest,
    outputs: Any,
    load_seconds: float,
    run_seconds: float,
) -> None:
    """Prints what a run did: JSON, or lines for people."""
    spec = manifest.spec(args.name)  # from a bundle: the entry that was loaded
    result = {
        "name": args.name,
        "key": spec.key,
        "load_seconds": load_seconds,
        "primed": args.prime and args.name in manifest.prime([args.name]),
        "run_seconds": run_seconds,
        "outputs": describe(outputs),
    }
    if args.json:
        print(json.dumps(finite_sums(result), indent=2, allow_nan=False))
        return
    where = f"a pool of {args.workers}" if args.workers else "this process"
    if cluster_address(args):
        where = f"the cluster at {cluster_address(args)}"
    print(
        f"{args.name}: loaded{' and primed' if result['primed'] else ''} from the "
        f"{'bundle' if manifest.bundle else 'cache'} in "
        f"{result['load_seconds'] * 1000:.1f} ms "
        f"({where}), ran in {result['run_seconds'] * 1000:.2f} ms"
    )
    for index, output in enumerate(result["outputs"]):
        total = "" if output["sum"] is None else f", sum {output['sum']:.6g}"
        print(f"  output {index}: {output['dtype']}{output['shape']}{total}")
