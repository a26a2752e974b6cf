"""The ``pjrt-pool`` command line: one module per command.

Runs in the parent process. main.py parses the command line and reports
usage errors for every command; warm.py (warm, run), cache.py (cache ...)
and check.py (check-plugin) each register their subcommands.
"""
