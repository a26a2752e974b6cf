"""The old import path of compile_options, whose home is now worker.identity.options.

compile_options (exported by ``worker`` and ``pool``) was defined here, with
the key parts of this process (now worker.identity.target); it is
re-exported so that code importing it from here goes on working.
"""

from worker.identity.options import compile_options

__all__ = ["compile_options"]
