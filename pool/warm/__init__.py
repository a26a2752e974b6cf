"""Warming the disk cache: the programs a user asks for, compiled and recorded.

Runs in the parent process (pjrt-pool warm, or a user's script). spec_file.py
reads a warm spec (the Python file whose programs() lists the programs);
warming.py lowers, compiles and reports each program, and report.py is what
it reports (WarmReport); lowerer.py lowers them while others compile, in a
thread or in extra processes (--lower-workers).
"""

from pool.warm.spec_file import SpecError, WarmProgram, load_spec

__all__ = ["SpecError", "WarmProgram", "load_spec"]
