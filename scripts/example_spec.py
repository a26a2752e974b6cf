"""An example warm spec: pjrt-pool's built-in example programs.

    pjrt-pool warm scripts/example_spec.py --manifest example-manifest.json
    pjrt-pool run example-manifest.json mlp_medium

A spec is a Python file whose ``programs()`` returns (or yields) entries:

- ``(name, function, shapes)`` tuples, optionally with a platform and a list
  of custom-call targets: ``(name, function, shapes, "cpu", ["my_target"])``;
- ``pool.warm.WarmProgram(...)`` records, which can also carry compile
  options;
- already lowered ``LoweredProgram``s, or ``(name, LoweredProgram)`` pairs.

It may define ``initialize()``, which runs in every worker after the plugin
loads (for example to call ``worker.register_custom_call`` for the targets
the programs use). ``module:function`` names a spec function in a module.
"""

from __future__ import annotations

from examples import example_programs


def programs() -> list[tuple]:
    """The example programs: MLPs and their gradients, convolutions, scans, attention,
    linalg, FFT, sorting, loops and a tiny program."""
    return list(example_programs())
