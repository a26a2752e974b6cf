"""The ``pjrt-pool`` command line: one module per command.

Runs in the parent process that the ``pjrt-pool`` command starts. main.py parses the command
line and reports usage errors for every command (a command raises UsageError; main prints it
and exits 2); interrupts.py says how every command ends on SIGINT and SIGTERM, start-up
included; warm.py (warm, run), bundle.py (bundle ...), cache.py (cache ...) and check.py
(check-plugin) each register their subcommands; cache_remote.py (cache push/pull/gc),
cache_explain.py (cache explain) and cluster_run.py (run --scheduler or --ray) hold the
remote tier's, the miss explanation's and the cluster's halves of those commands. Shared by
several: options.py (the options several commands take, --remote and --scheduler|--ray among
them, sizes and durations), jax_cache_options.py (--jax-cache and the target of JAX's cache
entries, for warm and cache explain), run_files.py (a run's inputs from .npz/.npy files and
its report), paths.py (paths given on the command line). version.py says what ``pjrt-pool
--version`` prints. Every help text is for users, and docs/cli.md's reference is made of
them (tools/cli_reference.py).
"""
