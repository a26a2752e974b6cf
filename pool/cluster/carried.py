"""A node's exceptions on their way to the client, and the error of a node that was lost.

Every task of a ClusterPool, on Dask or on Ray, runs in its node's Pool and
hands the client that Pool's exception unchanged (WorkerCrashedError,
TaskTimeoutError, ProgramQuarantinedError, NeverCompileError, ...). Neither
engine's own way of sending exceptions keeps them whole: Dask pickles them
with tblib, which cannot rebuild exceptions of two bases (TaskTimeoutError is
a PoolError and a TimeoutError), and Ray wraps them in a RayTaskError of
their class. So a node carries its exception as a CarriedError, pickled with
the standard pickle, and the client raises original_error() of it.
"""

from __future__ import annotations

import pickle

from pool.errors import PoolError
from worker.errors import PjrtPoolError


class NodeLostError(PoolError):
    """The node running a task was lost, and the task was not run again.

    With retry_lost=False this is the first loss; otherwise the task was run
    again on other nodes until the cluster's allowed losses were used up (on
    Dask, the scheduler's distributed.scheduler.allowed-failures; on Ray,
    pool.cluster.ray.pool.ALLOWED_LOSSES). Closing a ClusterPool also fails with it a
    task that can no longer end (no node left to run it, or lost with its node and never
    settled by the engine: ClusterPoolBase.close).
    """


class CarriedError(PjrtPoolError):
    """A node Pool's exception on its way to the client, pickled with the standard pickle
    (see the module docstring). Its text names the original, for an engine's own future of
    the task (a Dask future) that shows it."""

    def __init__(self, payload: bytes, text: str) -> None:
        super().__init__(payload, text)
        self.payload = payload

    def __str__(self) -> str:
        return str(self.args[1])

    @classmethod
    def of(cls, error: BaseException) -> CarriedError:
        """Carries an exception (one that does not pickle travels as a PoolError of its text)."""
        text = f"{type(error).__name__}: {error}"
        try:
            payload = pickle.dumps(error)
            pickle.loads(payload)
        except Exception:
            payload = pickle.dumps(PoolError(text))
        return cls(payload, text)


def original_error(error: BaseException) -> BaseException:
    """The exception a CarriedError carries; any other exception as it is.

    One that does not unpickle here (its class is importable on the node
    only, say) comes back as a PoolError of the node's text.
    """
    if not isinstance(error, CarriedError):
        return error
    try:
        return pickle.loads(error.payload)  # from the cluster's nodes, as all of its data is
    except Exception as failure:
        rebuilt = PoolError(
            f"{error} (the node's exception could not be rebuilt here: "
            f"{type(failure).__name__}: {failure})"
        )
        rebuilt.__cause__ = failure
        return rebuilt
