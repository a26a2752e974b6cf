"""The outcomes of a case, and which of them fail a check."""

from __future__ import annotations

import enum


class Status(enum.StrEnum):
    """What became of a case (a str: compares equal to its value, and is it in JSON)."""

    PASS = "pass"
    """The plugin's outputs are JAX's, within the case's budget."""
    WRONG = "wrong"
    """The plugin's outputs differ from JAX's beyond the budget."""
    ERROR = "error"
    """The plugin (or lowering the case) raised an error."""
    CRASH = "crash"
    """The plugin's worker died on the case."""
    TIMEOUT = "timeout"
    """The plugin's worker did not finish the case in time."""
    REFERENCE_ERROR = "reference error"
    """jax.jit raised an error on the case: there is nothing to compare with."""
    REFERENCE_CRASH = "reference crash"
    """The process that runs jax.jit died on the case (it was restarted for the others)."""
    REFERENCE_TIMEOUT = "reference timeout"
    """jax.jit did not finish the case in time (its process was restarted for the others)."""
    UNSUPPORTED = "unsupported"
    """The case needs an element type the plugin does not compile at all (type_probe.py)."""
    SKIPPED = "skipped"
    """The plugin lacks a capability the case needs (LAPACK kernels, a StableHLO version)."""


STATUSES = tuple(Status)
"""Every outcome, in the order of the report."""

PLUGIN_FAILURES = frozenset({Status.WRONG, Status.ERROR, Status.CRASH, Status.TIMEOUT})
"""The outcomes that are the plugin's failures."""

REFERENCE_FAILURES = frozenset(
    {Status.REFERENCE_ERROR, Status.REFERENCE_CRASH, Status.REFERENCE_TIMEOUT}
)
"""The outcomes where JAX's side failed: the plugin's result could not be checked."""

NOT_RUN = frozenset({Status.UNSUPPORTED, Status.SKIPPED})
"""The outcomes of cases the plugin could not be given: they do not fail a check."""
