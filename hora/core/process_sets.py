"""Process sets: collectives over a subset of the ranks, each set with its own names.

    even = hora.add_process_set([0, 2])          # called on every rank, in the same order
    if hora.rank() in (0, 2):
        hora.allreduce(x, process_set=even)

A set is registered through the coordinator like any collective (every rank must call
``add_process_set`` / ``remove_process_set`` with the same ranks, in the same order), so no
rank can use a set before the coordinator knows it.  ``init(process_sets=[...])`` registers
sets up front, as Horovod's does.  ``add_process_set_by_members`` is registered by the set's
own ranks alone (torch.distributed's groups of some ranks).  Layer: core.
"""
from __future__ import annotations

import collections
import weakref
import zlib
from typing import Iterable, Optional, Union

from ..errors import InvalidArgumentError
from . import state
from .messages import ADD_SET, AMONG, REMOVE_SET, Request

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "add_process_set_by_members",
           "remove_process_set",
           "registered_sets", "set_id_of", "member_set_id"]


class ProcessSet:
    """A subset of the job's ranks that can run collectives among themselves.

    Args:
        ranks_or_comm: the global ranks in the set (any order; kept sorted).  Horovod also
            takes an MPI communicator here; hora does not yet.
    """

    def __init__(self, ranks_or_comm: Optional[Iterable[int]]) -> None:
        if hasattr(ranks_or_comm, "Get_group"):          # an mpi4py communicator
            raise NotImplementedError("process sets from MPI communicators are not supported "
                                      "yet; pass the list of ranks")
        self._ranks = (None if ranks_or_comm is None
                       else sorted(int(r) for r in ranks_or_comm))
        self.process_set_id = None

    @property
    def ranks(self) -> list[int]:
        if self._ranks is None:                  # the global set: whatever the job is
            return list(range(state.size()))
        return list(self._ranks)

    def size(self) -> int:
        """Number of ranks in the set."""
        return len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set."""
        ranks = self.ranks
        me = state.rank()
        if me not in ranks:
            raise ValueError(f"rank {me} is not in process set {ranks}")
        return ranks.index(me)

    def included(self) -> bool:
        """True when this process belongs to the set."""
        return state.rank() in self.ranks

    def __repr__(self) -> str:
        ranks = "all ranks" if self._ranks is None else self._ranks
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={ranks})"


global_process_set = ProcessSet(None)
global_process_set.process_set_id = 0

# One job's registrations, which init() forgets (forget_sets): the sets added in it, whose
# ids mean something to this job's coordinator only, and the count of add/remove calls that
# names their requests (every rank of a new job counts from 0, a fresh process included).
# The global set is always id 0 and stays the object users imported.
_counter = [0]
_among: dict[tuple[int, ...], int] = {}     # members-only adds of these ranks so far
_registered: weakref.WeakSet[ProcessSet] = weakref.WeakSet()


def forget_sets() -> None:
    """A new job: no set of the last job is registered in it (add them again)."""
    for process_set in list(_registered):
        process_set.process_set_id = None
    _registered.clear()
    _counter[0] = 0
    _among.clear()


def registered_sets() -> list[ProcessSet]:
    """The sets added in this job and not removed (the global set is not among them)."""
    return list(_registered)


def set_id_of(process_set: Optional[ProcessSet]) -> int:
    """The id to put in a request for ``process_set`` (None: the global set)."""
    if process_set is None or process_set is global_process_set:
        return 0
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a hora ProcessSet, got {process_set!r}")
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set!r} has not been added: call "
                         f"hora.add_process_set() on every rank first")
    return process_set.process_set_id


def member_set_id(process_set: Optional[ProcessSet], what: str) -> int:
    """:func:`set_id_of` for a collective ``what`` that this rank calls on ``process_set``:
    raises :class:`~hora.errors.InvalidArgumentError` unless this rank is a member (as
    Horovod refuses it; the members are not waiting for this rank, so nothing is sent)."""
    set_id = set_id_of(process_set)
    if set_id and not process_set.included():
        raise InvalidArgumentError(f"{what}: rank {state.rank()} is not a member of the "
                                   f"provided process set (id {set_id}, ranks "
                                   f"{process_set.ranks})")
    return set_id


def add_process_set(process_set: Union[ProcessSet, Iterable[int]]) -> ProcessSet:
    """Register a set on every rank (a collective over all ranks); returns the ProcessSet."""
    return _add(process_set, members_only=False)


def add_process_set_by_members(process_set: Union[ProcessSet, Iterable[int]]) -> ProcessSet:
    """Register a set by its own ranks, the others not calling (as torch makes a group of
    some ranks on those ranks only); returns the ProcessSet.  Each member must add the
    sets it belongs to in the same order as the other members do."""
    return _add(process_set, members_only=True)


def _add(process_set, members_only):
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set!r} is already registered")
    ranks = tuple(process_set.ranks)
    twice = sorted(r for r, times in collections.Counter(ranks).items() if times > 1)
    if twice:       # (the set would wait for more ranks than it has)
        raise ValueError(f"a process set names each rank once; {list(ranks)} names "
                         f"{', '.join(map(str, twice))} more than once")
    if members_only:
        if state.rank() not in ranks or not all(0 <= r < state.size() for r in ranks):
            raise ValueError(f"add_process_set_by_members({list(ranks)}) on rank "
                             f"{state.rank()} of {state.size()}: the set's ranks add it, "
                             f"and they must be ranks of the job")
        # named by its ranks and how many sets of these ranks came before (members only
        # count them, so the other ranks' calls cannot shift the name)
        _among[ranks] = count = _among.get(ranks, 0) + 1
        digest = zlib.crc32(repr(ranks).encode())
        name, root = f"process_set.among.{digest:08x}.{len(ranks)}.{count}", AMONG
    else:
        _counter[0] += 1
        name, root = f"process_set.add.{_counter[0]}", -1
    req = Request(name, ADD_SET, "", (ranks,), -1, root, 1.0, 1.0, None)
    process_set.process_set_id = state.engine().submit(req, []).wait()
    _registered.add(process_set)
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set on every rank (a collective over all ranks).  Returns True."""
    set_id = set_id_of(process_set)
    _counter[0] += 1
    req = Request(f"process_set.remove.{_counter[0]}", REMOVE_SET, "", ((set_id,),), -1, -1,
                  1.0, 1.0, None)
    state.engine().submit(req, []).wait()
    process_set.process_set_id = None
    _registered.discard(process_set)
    return True
