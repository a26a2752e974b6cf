"""The ``pjrt-pool`` command line: one module per command.

Runs in the parent process that the ``pjrt-pool`` command starts. main.py
parses the command line and reports usage errors for every command (a
command raises UsageError; main prints it and exits 2); warm.py (warm,
run), bundle.py (bundle ...), cache.py (cache ...) and check.py
(check-plugin) each register their subcommands.
"""
