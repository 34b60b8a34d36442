"""Automatic names of collectives: ``<kind>.noname.<n>`` (``<kind>.noname.ps<id>.<n>`` on
process set ``id``), counted per base name and process set from 0 in each job and again
after every join(), so that ranks which make the same unnamed calls in the same order agree
on their names.  Layer: core.
"""
from __future__ import annotations

import itertools
from typing import Any, Iterator, Optional

from .messages import KIND_NAMES

__all__ = ["auto_name", "name_of", "restart_names"]

# the counters behind automatic names ("allreduce.noname.<n>"; hora.core.objects'
# "broadcast_object.<n>"), one per (base name, process set id): a collective on a set
# advances the count of its members only, so a count shared by every set would drift apart
# between members and non-members, and the next unnamed global collective would get a
# different name on each (a stall); an object collective counts apart from the plain ones of
# its kind for the same reason.  Set ids are never reused within a job, and init() restarts
# the counts (restart_names), as Horovod restarts its handle numbers at shutdown, so that
# every rank of a new job counts from 0, a fresh process and one that was in the last job
# alike.  join() restarts them too: every rank has then finished every earlier collective,
# and the calls each made while others had joined (refused, or not made at all) leave the
# counts no trace that would set the ranks' next names apart
_counters: dict[tuple[str, int], Iterator[int]] = {}


def restart_names():
    """A new job, or every rank joined: automatic names count from 0 again."""
    _counters.clear()


def auto_name(kind: int, ps: int, base: Optional[str] = None) -> str:
    """The next automatic name for a collective of ``kind`` on process set id ``ps``:
    ``<base>.<n>`` on the global set, ``<base>.ps<id>.<n>`` on another (``base`` defaults to
    ``<kind>.noname``).  For hora's own collectives and the bindings' calls that submit
    several under one name."""
    base = f"{KIND_NAMES[kind]}.noname" if base is None else base
    counter = _counters.get((base, ps))
    if counter is None:
        counter = _counters[(base, ps)] = itertools.count()
    n = next(counter)
    return f"{base}.{n}" if ps == 0 else f"{base}.ps{ps}.{n}"


def name_of(kind: int, name: Any, ps: int) -> str:
    """A call's ``name``, or the next automatic one when it is None."""
    if name is None:
        return auto_name(kind, ps)
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    return name
