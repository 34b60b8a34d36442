"""Collectives of Python objects: ``broadcast_object`` and ``allgather_object``.

An object travels as its (cloud)pickle through byte broadcasts and allgathers.  Unpickling
what a peer sent runs whatever it names, so with a job key anyone could derive (torchrun
across hosts or SageMaker without HORA_SECRET: :mod:`hora.core.topology`) objects travel as
plain data only.  Layer: core.
"""
from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any, Optional, TypeVar

import numpy as np

from ..rendezvous.safepickle import PayloadRefusedError, SafeDecoder
from . import state
from .messages import ALLGATHER, BROADCAST
from .names import auto_name
from .ops import allgather, broadcast
from .process_sets import set_id_of
from .standins import abort_call

if TYPE_CHECKING:
    from .process_sets import ProcessSet

__all__ = ["broadcast_object", "allgather_object", "allow_objects"]

T = TypeVar("T")

# With a job key anyone could derive (torchrun across hosts or SageMaker without
# HORA_SECRET: hora.core.topology), a process that registered as a rank before the real one
# would be a peer, and unpickling its bytes could run its code.  Then objects are sent and
# received as plain data only (hora.rendezvous.safepickle), plus what the bindings declare
# safe (allow_objects): the sender checks its own object first, so a refused one fails the
# call on every rank, naming the way out, instead of on the receivers alone.
_object_classes = []
_object_names = {}


def allow_objects(classes=(), names=None):
    """Let object collectives carry ``classes`` (and the ``{(module, name): object}``
    constants ``names``) beside plain data when the job key is derivable: for a binding's
    own containers, whose construction runs no code.  Called by bindings at import."""
    _object_classes.extend(classes)
    _object_names.update(names or {})


def _plain_only():
    return not state._require().placement.secret_is_real


def _decoder():
    return SafeDecoder(_object_classes, _object_names)


def _dumps(obj):
    try:
        import cloudpickle
        data = cloudpickle.dumps(obj)
    except ImportError:
        data = pickle.dumps(obj)
    if _plain_only():
        try:
            _decoder().loads(data)
        except PayloadRefusedError as e:
            where = state._require().placement.source
            raise TypeError(
                f"this job's key ({where}, no HORA_SECRET) is derived from public values, "
                f"so objects travel as plain data only (None, bool, numbers, str, bytes, "
                f"tuples, lists, dicts, sets, numpy arrays) and this one is not: {e}.  "
                f"Set HORA_SECRET or HORA_SECRET_FILE on every rank to send any object") from e
    return np.frombuffer(data, dtype=np.uint8)


def _loads(data):
    if _plain_only():
        return _decoder().loads(data)
    return pickle.loads(data)


def broadcast_object(obj: T, root_rank: int = 0, name: Optional[str] = None,
                     process_set: Optional[ProcessSet] = None) -> T:
    """``root_rank``'s ``obj`` (anything picklable), on every rank."""
    name = name or auto_name(BROADCAST, set_id_of(process_set), "broadcast_object")
    try:
        payload = _dumps(obj) if state.rank() == root_rank else np.empty(0, np.uint8)
    except Exception as e:
        abort_call(BROADCAST, f"{name}.len", process_set, e)
        raise
    length = broadcast(np.array([payload.size], dtype=np.int64), root_rank, f"{name}.len",
                       process_set)
    if state.rank() != root_rank:
        payload = np.empty(int(length[0]), dtype=np.uint8)
    data = broadcast(payload, root_rank, f"{name}.data", process_set)
    return obj if state.rank() == root_rank else _loads(data.tobytes())


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: Optional[ProcessSet] = None) -> list[Any]:
    """The list of every rank's ``obj``, in rank order."""
    name = name or auto_name(ALLGATHER, set_id_of(process_set), "allgather_object")
    try:
        payload = _dumps(obj)
    except Exception as e:
        abort_call(ALLGATHER, f"{name}.len", process_set, e)
        raise
    sizes = allgather(np.array([payload.size], dtype=np.int64), f"{name}.len", process_set)
    data = allgather(payload, f"{name}.data", process_set)
    out, offset = [], 0
    for n in sizes:
        out.append(_loads(data[offset:offset + int(n)].tobytes()))
        offset += int(n)
    return out

