"""The old import path of the public names whose home is now worker.identity.keys.

explain_key (exported by ``worker``) and InvalidKeyError (by ``pool``) were
defined here; they are re-exported so that code importing them from here
goes on working. Everything else about keys is in worker.identity.
"""

from worker.identity.keys import InvalidKeyError, explain_key

__all__ = ["InvalidKeyError", "explain_key"]
