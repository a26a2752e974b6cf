"""The worker side's loggers (worker.log): no `import logging` on a serving start, same messages.

A serving process that loads and runs a warmed program never configures
logging; importing it cost about 2 ms of the start (benchmarks/bench_start.py).
(jaxlib's own client, the cpu platform's runtime, imports it itself: pjrt-pool
does not.)
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
from conftest import run_python

from pool import compile_program, lower
from pool.manifest import Manifest
from worker.records import ProgramSpec


def test_loading_and_running_from_a_manifest_imports_no_logging(tmp_path, cache_dir):
    program = lower(lambda x: x * 3.0, [jax.ShapeDtypeStruct((4,), jnp.float32)])
    executable, _ = compile_program(program, cache_dir=cache_dir)
    manifest = tmp_path / "app.json"
    Manifest([ProgramSpec.from_executable("triple", executable)], str(cache_dir), "cpu").write(
        manifest
    )
    done = run_python(
        f"""
        import builtins, sys, numpy as np
        importers = []  # the modules that imported logging first, and so loaded it
        real_import = builtins.__import__
        def traced(name, globals=None, *args, **kwargs):
            if name == "logging" and "logging" not in sys.modules:
                importers.append((globals or {{}}).get("__name__", "?"))
            return real_import(name, globals, *args, **kwargs)
        builtins.__import__ = traced
        from pool.manifest import load_manifest
        outputs = load_manifest({str(manifest)!r}).run("triple", [np.ones(4, np.float32)])
        print(outputs[0].tolist(), [m for m in importers if not m.startswith("jaxlib")])
        """
    )
    assert done.stdout.split("\n")[0] == "[3.0, 3.0, 3.0, 3.0] []", done.stdout + done.stderr


def test_warnings_still_reach_stderr_and_debug_is_dropped_when_nothing_configured():
    done = run_python(
        """
        import sys
        from worker.log import get_logger
        log = get_logger("pjrt_pool.test")
        log.debug("not shown %s", 1)
        log.info("not shown either")
        print("logging imported after debug:", "logging" in sys.modules, flush=True)
        log.warning("shown %s", 2)
        """
    )
    assert "logging imported after debug: False" in done.stdout
    assert done.stderr.strip() == "shown 2"


def test_a_configured_process_gets_every_message_with_its_callers_place():
    done = run_python(
        """
        import json, logging, sys
        records = []
        class Keep(logging.Handler):
            def emit(self, record):
                records.append([record.levelname, record.name, record.module, record.funcName,
                                record.getMessage(), record.exc_info is not None])
        logging.getLogger("pjrt_pool").addHandler(Keep())
        logging.getLogger("pjrt_pool").setLevel(logging.DEBUG)
        from worker.log import get_logger
        log = get_logger("pjrt_pool.test")
        def caller():
            log.debug("d %s", 1)
            log.info("i", stacklevel=1)
            try:
                raise ValueError("boom")
            except ValueError:
                log.exception("e")
        caller()
        print(json.dumps(records))
        """
    )
    module = "<string>"  # run_python's code runs as -c
    assert json.loads(done.stdout) == [
        ["DEBUG", "pjrt_pool.test", module, "caller", "d 1", False],
        ["INFO", "pjrt_pool.test", module, "caller", "i", False],
        ["ERROR", "pjrt_pool.test", module, "caller", "e", True],
    ]
