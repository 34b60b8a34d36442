"""The records of an elastic job's rounds in the rendezvous store: what the launcher writes
(:mod:`hora.runner.elastic`, Ray's elastic driver) and the workers read
(:mod:`hora.core.membership`), named once for both.

Round ``n`` is the record under ``elastic/round/<n>`` (:func:`round_record`), the newest
round's number is under ``elastic/latest``, and a worker waiting to be placed says so under
``elastic/ready/<worker id>``.

Layer: rendezvous.  Imports nothing from hora.
"""
import time

__all__ = ["ROUND_PREFIX", "READY_PREFIX", "LATEST_KEY", "round_record"]

ROUND_PREFIX = "elastic/round/"     # + n: the round's record (see round_record)
READY_PREFIX = "elastic/ready/"     # + worker id: the worker waits to be placed
LATEST_KEY = "elastic/latest"       # the newest round's number


def round_record(n, members, change, when=None):
    """The store's record of round ``n``: ``members`` (worker id, host) in rank order, and
    what changed since the round before (``"start"``, ``"added"``, ``"removed"``,
    ``"mixed"``).  Plain data, as everything in the store."""
    return {"round": n, "members": [[str(w), str(h)] for w, h in members],
            "change": change, "time": time.time() if when is None else when}
