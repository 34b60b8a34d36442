"""Collectives on NumPy arrays, with Horovod's names and arguments.

One primitive per collective (``*_async`` returns a :class:`~hora.core.handles.Handle`); the
synchronous form is ``synchronize(*_async(...))``.  Names are optional: an unnamed collective
is called ``<kind>.noname.<n>`` (``<kind>.noname.ps<id>.<n>`` on process set ``id``), with
``n`` counted per kind and per process set from 0 in each job (each ``init()``) and after
each join(), so the members of a set that issue unnamed collectives on it in the same order
agree on their names, whatever other sets each of them took part in.

A call whose arguments fail their checks raises ``TypeError``/``ValueError`` on its rank, as
in Horovod, and also submits a stand-in for the collective (:mod:`hora.core.standins`), so
that the ranks that did submit it raise ``CollectiveAbortedError`` naming this rank and its
error rather than wait for it forever.  A call on a process set without this rank raises
``InvalidArgumentError`` and submits nothing (the members are not waiting for it).  Names
come from :mod:`hora.core.names`.  Layer: core.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import numpy as np

from ..errors import InvalidArgumentError
from . import state
from .handles import Handle
from .messages import (ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, JOIN,
                       OP_NAMES, REDUCESCATTER, Adasum, Average, Max, Min, Product, Request,
                       Sum)
from .names import auto_name
from .names import name_of as _name
from .names import restart_names as _restart_names
from .process_sets import global_process_set, member_set_id
from .standins import abort_call as _abort
from .standins import count as _count
from .standins import tell_peers, tells_peers  # noqa: F401 (the bindings' import place)

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

    from .process_sets import ProcessSet

__all__ = ["allreduce", "allreduce_async", "allreduce_async_", "allreduce_",
           "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_async_",
           "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
           "broadcast", "broadcast_async", "alltoall", "alltoall_async", "reducescatter",
           "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
           "barrier", "barrier_async", "join", "poll", "synchronize", "submit_deferred"]

def _array(x, what, device_ok=False):
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "hora_device"):
        if not device_ok:
            raise TypeError(f"{what}: runs on host (numpy) arrays only, got a "
                            f"{x.hora_device} array")
        return x
    try:
        return np.asarray(x)
    except Exception as e:
        raise TypeError(f"{what}: expected a numpy array, got {type(x).__name__}") from e


def _check_dtype(a, what):
    if a.dtype.kind not in "biufc":
        raise TypeError(f"{what}: unsupported dtype {a.dtype} (numeric and bool only)")


def _check_op(op, a, what, prescale, postscale):
    if op == Adasum:
        raise NotImplementedError(f"{what}: the Adasum op is not implemented yet")
    if op not in OP_NAMES:
        raise ValueError(f"{what}: unknown reduce op {op!r}")
    if a.dtype == np.bool_ and (op == Average or prescale != 1 or postscale != 1):
        raise TypeError(f"{what}: bool arrays support Sum, Min, Max and Product without "
                        f"scaling (got op={OP_NAMES[op]})")


def _device(a, what, ps):
    """Where ``a``'s data lives: "" for a numpy array, else the device type of a *device
    array* -- a framework tensor that a device plane reduces where it lives (the binding
    makes them: ``hora_device``, ``shape``, ``dtype``, ``size``, ``ndim``, and for the plane
    ``tensor`` and ``ready``).  Device planes serve the global process set only."""
    device = getattr(a, "hora_device", "")
    if device and ps != 0:
        raise ValueError(f"{what}: {device} arrays run in the global process set only")
    return device


def _submit(req, arrays, finish=None, inplace=False):
    return state.engine().submit(req, arrays, finish, inplace)


def wait_now(start):
    """Run ``start()`` (which submits collectives and returns a handle) and wait for it: a
    blocking call, whose thread runs the engine itself while it waits (see Engine.drive).
    Used by the blocking functions here and by the framework bindings."""
    return state.engine().submit_waiting(start).wait()


def submit_deferred(start):
    """Run ``start()``, which submits collectives that this thread will wait for soon,
    without waking the engine thread for them: the waiting thread sends and runs them itself
    (see Engine.drive), or else the engine thread's periodic look sends them (within half a
    second).  For a caller with no CPU to spare for the engine thread.  Returns what
    ``start`` returns."""
    return state.engine().submit_waiting(start)


def poll(handle: AnyHandle) -> bool:
    """True when the collective behind ``handle`` has finished."""
    return handle.poll()


def synchronize(handle: AnyHandle, timeout: Optional[float] = None) -> Any:
    """Wait for ``handle``'s collective and return its result (raises its error)."""
    return handle.wait(timeout)


# -- allreduce -----------------------------------------------------------------------------
def allreduce_async(array: ArrayLike, op: Optional[int] = None, name: Optional[str] = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    average: Optional[bool] = None,
                    process_set: Optional[ProcessSet] = None) -> Handle:
    """Start reducing ``array`` across all ranks; returns a Handle.

    Args:
        array: numpy array (any numeric dtype, or bool for Sum/Min/Max/Product).
        op: Average (default), Sum, Min, Max or Product.
        name: a name unique among outstanding collectives; auto-named when omitted.
        prescale_factor, postscale_factor: multiply before / after the reduction.
        average: deprecated Horovod argument; True means Average, False means Sum.
        process_set: run among the ranks of this ProcessSet only (default: every rank).

    Integer arrays are reduced in their own dtype (a sum may wrap around, as in Horovod);
    Average and the scale factors are then applied in float64 and truncated toward zero.
    """
    return _grouped_async([array], op, name, prescale_factor, postscale_factor, average,
                          process_set, single=True)


def allreduce(array: ArrayLike, op: Optional[int] = None, name: Optional[str] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              average: Optional[bool] = None,
              process_set: Optional[ProcessSet] = None) -> np.ndarray:
    """Reduce ``array`` across all ranks and return the result (a new array).

    Example:
        >>> total = hora.allreduce(np.ones(3), op=hora.Sum)   # == size() everywhere
    """
    done = _repeated(array, op, name, prescale_factor, postscale_factor, average, process_set,
                     False)
    if done is not None:
        return done
    return _blocking(array, op, name, prescale_factor, postscale_factor, average, process_set,
                     False, allreduce_async)


def grouped_allreduce_async(arrays: Sequence[ArrayLike], op: Optional[int] = None,
                            name: Optional[str] = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, average: Optional[bool] = None,
                            process_set: Optional[ProcessSet] = None) -> AnyHandle:
    """Reduce a list of arrays as one atomically negotiated collective; returns a Handle."""
    return _grouped_async(arrays, op, name, prescale_factor, postscale_factor, average,
                          process_set)


def grouped_allreduce(arrays: Sequence[ArrayLike], op: Optional[int] = None,
                      name: Optional[str] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, average: Optional[bool] = None,
                      process_set: Optional[ProcessSet] = None) -> list[np.ndarray]:
    """Reduce a list of arrays together; returns the list of results."""
    return wait_now(lambda: grouped_allreduce_async(arrays, op, name, prescale_factor,
                                               postscale_factor, average, process_set))


def _resolve_op(op, average):
    if average is not None:
        if op is not None:
            raise ValueError("pass either op= or the deprecated average=, not both")
        return Average if average else Sum
    return Average if op is None else op


def allreduce_async_(array: np.ndarray, op: Optional[int] = None, name: Optional[str] = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     average: Optional[bool] = None,
                     process_set: Optional[ProcessSet] = None) -> Handle:
    """In-place :func:`allreduce_async`: the result is written into ``array`` (which must be a
    writable numpy array), and ``synchronize`` returns it."""
    return _grouped_async([array], op, name, prescale_factor, postscale_factor, average,
                          process_set, single=True, inplace=True)


def allreduce_(array: np.ndarray, op: Optional[int] = None, name: Optional[str] = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               average: Optional[bool] = None,
               process_set: Optional[ProcessSet] = None) -> np.ndarray:
    """In-place :func:`allreduce`: the result is written into ``array`` (a writable numpy
    array), which is returned.  No buffer is allocated for it."""
    done = _repeated(array, op, name, prescale_factor, postscale_factor, average, process_set,
                     True)
    if done is not None:
        return done
    return _blocking(array, op, name, prescale_factor, postscale_factor, average, process_set,
                     True, allreduce_async_)


def grouped_allreduce_async_(arrays: Sequence[np.ndarray], op: Optional[int] = None,
                             name: Optional[str] = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, average: Optional[bool] = None,
                             process_set: Optional[ProcessSet] = None) -> AnyHandle:
    """In-place :func:`grouped_allreduce_async`: results are written into ``arrays``."""
    return _grouped_async(arrays, op, name, prescale_factor, postscale_factor, average,
                          process_set, inplace=True)


_PLAIN_OPS = frozenset((Average, Sum, Min, Max, Product))


def _first(results):
    return results[0]


def _plain(a, op, name, average, process_set, inplace):
    """Whether an allreduce of ``a`` is the common call: one numpy array of a number dtype,
    a plain op, the global set (every check of :func:`_grouped_async` passes for it; a
    training loop makes thousands of these)."""
    return (a.__class__ is np.ndarray and average is None
            and (process_set is None or process_set is global_process_set)
            and a.dtype.kind in "iufc" and (op is None or op.__class__ is int and op in _PLAIN_OPS)
            and (not inplace or a.flags.writeable) and (name is None or name.__class__ is str))


def _repeated(array, op, name, prescale, postscale, average, process_set, inplace):
    """A blocking allreduce that a loop repeats, through its lane (``Engine.lane_now``:
    the same name, op, scale factors, dtype and shape as a call the engine settled before):
    the result, or None where there is no lane for it or the lane did not take it (then
    :func:`_blocking`).  Apart from :func:`_blocking`, and first: a step less each call."""
    ctx = state._ctx
    if ctx is None or average is not None:
        return None
    try:
        lane = ctx.engine.lanes.get(name)       # (the lane made last for the name)
    except TypeError:           # (unhashable: not the common call)
        return None
    if (lane is not None and (op is lane.op or op is None and lane.op == Average)
            and array.__class__ is np.ndarray and array.dtype is lane.dtype
            and array.shape == lane.shape and prescale == 1.0 and postscale == lane.postscale
            and (process_set is None or process_set is global_process_set)
            and (not inplace or array.flags.writeable)):
        return ctx.engine.lane_now(lane, array, inplace)
    return None


def _blocking(array, op, name, prescale, postscale, average, process_set, inplace, start):
    """A blocking allreduce of ``array`` that :func:`_repeated` did not settle: the common
    call (:func:`_plain`) that the engine can settle at once goes straight to
    :meth:`Engine.allreduce_now`; any other waits for ``start``'s handle (the asynchronous
    function of the same arguments)."""
    if _plain(array, op, name, average, process_set, inplace):
        engine = state._require().engine
        if engine.quick_fits(array.nbytes):     # (_plain: the name is a str, or None)
            return engine.allreduce_now(array, Average if op is None else op,
                                        auto_name(ALLREDUCE, 0) if name is None else name,
                                        prescale, postscale, inplace)
    return wait_now(lambda: start(array, op, name, prescale, postscale, average, process_set))


def _grouped_async(arrays, op, name, prescale, postscale, average, process_set, single=False,
                   inplace=False):
    if len(arrays) == 1 and _plain(arrays[0], op, name, average, process_set, inplace):
        a = arrays[0]
        req = Request(_name(ALLREDUCE, name, 0), ALLREDUCE, a.dtype.str, (a.shape,),
                      Average if op is None else op, -1, float(prescale),
                      float(postscale), None, 0, "")
        return _submit(req, arrays, _first if single else None, inplace)
    try:
        op = _resolve_op(op, average)
        arrays = [_array(a, "allreduce", device_ok=True) for a in arrays]
        label = f"allreduce {name!r}" if name is not None else "allreduce"
        if not arrays:
            raise ValueError(f"grouped_{label}: no arrays given")
        ps = member_set_id(process_set, label)
        by_kind = {}                        # (dtype, device) -> indices
        for i, a in enumerate(arrays):
            device = _device(a, label, ps)
            if inplace and not (device or (isinstance(a, np.ndarray) and a.flags.writeable)):
                raise ValueError(f"{label}: in-place operations need writable numpy arrays")
            by_kind.setdefault((a.dtype.str, device), []).append(i)
        for idx in by_kind.values():        # the checks depend on the dtype alone
            _check_dtype(arrays[idx[0]], label)
            _check_op(op, arrays[idx[0]], label, prescale, postscale)
    except Exception as e:
        _abort(ALLREDUCE, name, process_set, e)
        raise
    # drawn after the checks: a call that fails them draws it in _abort instead
    name = _name(ALLREDUCE, name, ps)
    if len(by_kind) == 1:
        ((dt, device),) = by_kind
        req = Request(name, ALLREDUCE, dt, tuple(a.shape for a in arrays), op, -1,
                      float(prescale), float(postscale), None, ps, device)
        return _submit(req, arrays, _first if single else None, inplace)
    # mixed dtypes (or devices): one collective each, reassembled in the caller's order
    handles = []
    for j, ((dt, device), idx) in enumerate(sorted(by_kind.items())):
        req = Request(f"{name}.{j}", ALLREDUCE, dt, tuple(arrays[i].shape for i in idx), op,
                      -1, float(prescale), float(postscale), None, ps, device)
        handles.append((idx, _submit(req, [arrays[i] for i in idx], None, inplace)))
    return _GroupHandle(name, handles, len(arrays))


class _GroupHandle:
    """Several collectives seen as one: ``parts`` is ``[(indices, Handle)]``; the result is
    the list of every part's results, each at its index."""

    def __init__(self, name, parts, n):
        self.name = name
        self._parts = parts
        self._n = n

    def poll(self):
        return all(h.poll() for _, h in self._parts)

    def wait(self, timeout=None):
        out = [None] * self._n
        for idx, h in self._parts:
            result = h.wait(timeout)
            for i, r in zip(idx, result if len(idx) > 1 or isinstance(result, list)
                            else [result]):
                out[i] = r
        return out


# what an asynchronous call returns: a grouped call's handle has the same poll() and wait()
AnyHandle = Union[Handle, _GroupHandle]


# -- allgather, broadcast, alltoall, reducescatter, barrier --------------------------------
def allgather_async(array: ArrayLike, name: Optional[str] = None,
                    process_set: Optional[ProcessSet] = None) -> Handle:
    """Start concatenating every rank's ``array`` along the first dimension (which may differ
    per rank; the other dimensions must agree)."""
    try:
        a = _allgather_input(array)
        ps = member_set_id(process_set, "allgather")
        _device(a, "allgather", ps)
    except Exception as e:
        _abort(ALLGATHER, name, process_set, e)
        raise
    return _submit(_allgather_request(a, _name(ALLGATHER, name, ps), ps), [a])


def _allgather_input(array):
    a = _array(array, "allgather", device_ok=True)
    _check_dtype(a, "allgather")
    return a


def _allgather_request(a, name, ps):
    return Request(name, ALLGATHER, a.dtype.str, (a.shape,), -1, -1, 1.0, 1.0, None, ps,
                   _device(a, "allgather", ps))


def allgather(array: ArrayLike, name: Optional[str] = None,
              process_set: Optional[ProcessSet] = None) -> np.ndarray:
    """Concatenation of every rank's ``array`` along the first dimension, in rank order."""
    return wait_now(lambda: allgather_async(array, name, process_set))


def grouped_allgather_async(arrays: Sequence[ArrayLike], name: Optional[str] = None,
                            process_set: Optional[ProcessSet] = None) -> AnyHandle:
    """Allgather each array of a list; returns a Handle whose result is the list."""
    try:
        arrays = [_allgather_input(a) for a in arrays]      # all checked before any is sent
        ps = member_set_id(process_set, "grouped_allgather")
        for a in arrays:
            _device(a, "allgather", ps)
    except Exception as e:
        _abort(ALLGATHER, name, process_set, e, _count(arrays))
        raise
    name = _name(ALLGATHER, name, ps)
    return _GroupHandle(name, [([i], _submit(_allgather_request(a, f"{name}.{i}", ps), [a]))
                               for i, a in enumerate(arrays)], len(arrays))


def grouped_allgather(arrays: Sequence[ArrayLike], name: Optional[str] = None,
                      process_set: Optional[ProcessSet] = None) -> list[np.ndarray]:
    """Allgather each array of a list; returns the list of results."""
    return wait_now(lambda: grouped_allgather_async(arrays, name, process_set))


def broadcast_async(array: ArrayLike, root_rank: int, name: Optional[str] = None,
                    process_set: Optional[ProcessSet] = None) -> Handle:
    """Start sending ``root_rank``'s ``array`` to every rank (same shape and dtype everywhere).

    ``root_rank`` is a global rank (a member of ``process_set`` when one is given)."""
    try:
        a = _array(array, "broadcast", device_ok=True)
        _check_dtype(a, "broadcast")
        if not isinstance(root_rank, (int, np.integer)):
            raise TypeError(f"broadcast: root_rank must be an int, got {root_rank!r}")
        ps = member_set_id(process_set, "broadcast")
        device = _device(a, "broadcast", ps)
    except Exception as e:
        _abort(BROADCAST, name, process_set, e)
        raise
    req = Request(_name(BROADCAST, name, ps), BROADCAST, a.dtype.str, (a.shape,), -1,
                  int(root_rank), 1.0, 1.0, None, ps, device)
    return _submit(req, [a])


def broadcast(array: ArrayLike, root_rank: int, name: Optional[str] = None,
              process_set: Optional[ProcessSet] = None) -> np.ndarray:
    """``root_rank``'s ``array``, on every rank."""
    return wait_now(lambda: broadcast_async(array, root_rank, name, process_set))


def alltoall_async(array: ArrayLike, splits: Optional[ArrayLike] = None,
                   name: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> Handle:
    """Start an all-to-all: rows ``splits[j]`` of ``array`` go to rank j.  Without
    ``splits`` the first dimension must divide evenly among the ranks (each gets the same
    number of rows).  The result is ``(received, received_splits)``.

    Raises:
        InvalidArgumentError: (a ``ValueError`` and a ``RuntimeError``) on this rank: rows
            that do not divide evenly without ``splits``; ``splits`` not of an integer
            dtype, or not one non-negative entry per rank summing to the first dimension.
    """
    try:
        a = _array(array, "alltoall")
        _check_dtype(a, "alltoall")
        ps = member_set_id(process_set, "alltoall")
        splits = _alltoall_splits(a, splits, name,
                                  state.size() if ps == 0 else process_set.size())
    except Exception as e:
        _abort(ALLTOALL, name, process_set, e)
        raise
    name = _name(ALLTOALL, name, ps)
    req = Request(name, ALLTOALL, a.dtype.str, (a.shape,), -1, -1, 1.0, 1.0, splits, ps)
    return _submit(req, [a])


def _alltoall_splits(a, splits, name, n):
    """``splits`` as a tuple of ints (None stays None), checked against ``a`` and the set's
    ``n`` ranks as Horovod checks them on each rank."""
    what = f"alltoall {name!r}" if name is not None else "alltoall"
    rows = a.shape[0] if a.ndim else 1
    if splits is None:
        if rows % n:
            raise InvalidArgumentError(
                f"{what}: splits not provided, but the first dimension ({rows}) is not a "
                f"multiple of the number of ranks ({n}); pass splits= to send uneven parts")
        return None
    given = np.asarray(splits)
    if given.size == 0:                     # (Horovod's "no splits": an empty tensor)
        return _alltoall_splits(a, None, name, n)
    if given.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{what}: splits must hold integers, got dtype "
                                   f"{given.dtype}")
    if given.ndim > 1:
        raise InvalidArgumentError(f"{what}: splits must be 1-D, got shape {given.shape}")
    out = tuple(int(v) for v in given.reshape(-1))
    if len(out) != n or any(v < 0 for v in out) or sum(out) != rows:
        raise InvalidArgumentError(f"{what}: splits {list(out)} must have {n} non-negative "
                                   f"entries (one per rank) summing to the first dimension "
                                   f"({rows})")
    return out


def alltoall(array: ArrayLike, splits: Optional[ArrayLike] = None, name: Optional[str] = None,
             process_set: Optional[ProcessSet] = None) -> tuple[np.ndarray, np.ndarray]:
    """All-to-all exchange; returns ``(received, received_splits)``."""
    return wait_now(lambda: alltoall_async(array, splits, name, process_set))


def reducescatter_async(array: ArrayLike, op: Optional[int] = None, name: Optional[str] = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        process_set: Optional[ProcessSet] = None) -> Handle:
    """Start reducing ``array`` across ranks and scattering the first dimension: rank r gets
    rows of block r (the first ``rows % size`` ranks get one extra row)."""
    op = Average if op is None else op
    try:
        a = _reducescatter_input(array, op, prescale_factor, postscale_factor)
        ps = member_set_id(process_set, "reducescatter")
    except Exception as e:
        _abort(REDUCESCATTER, name, process_set, e)
        raise
    req = _reducescatter_request(a, _name(REDUCESCATTER, name, ps), op, prescale_factor,
                                 postscale_factor, ps)
    return _submit(req, [a])


def _reducescatter_input(array, op, prescale, postscale):
    a = _array(array, "reducescatter")
    _check_dtype(a, "reducescatter")
    _check_op(op, a, "reducescatter", prescale, postscale)
    if a.ndim == 0:
        raise ValueError("reducescatter: needs at least one dimension (got a 0-d array)")
    return a


def _reducescatter_request(a, name, op, prescale, postscale, ps):
    return Request(name, REDUCESCATTER, a.dtype.str, (a.shape,), op, -1, float(prescale),
                   float(postscale), None, ps)


def reducescatter(array: ArrayLike, op: Optional[int] = None, name: Optional[str] = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  process_set: Optional[ProcessSet] = None) -> np.ndarray:
    """This rank's block of the reduction of every rank's ``array``."""
    return wait_now(lambda: reducescatter_async(array, op, name, prescale_factor, postscale_factor,
                                           process_set))


def grouped_reducescatter_async(arrays: Sequence[ArrayLike], op: Optional[int] = None,
                                name: Optional[str] = None, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0,
                                process_set: Optional[ProcessSet] = None) -> AnyHandle:
    """Reducescatter each array of a list; returns a Handle whose result is the list."""
    op = Average if op is None else op
    try:
        arrays = [_reducescatter_input(a, op, prescale_factor, postscale_factor)
                  for a in arrays]                          # all checked before any is sent
        ps = member_set_id(process_set, "grouped_reducescatter")
    except Exception as e:
        _abort(REDUCESCATTER, name, process_set, e, _count(arrays))
        raise
    name = _name(REDUCESCATTER, name, ps)
    parts = [([i], _submit(_reducescatter_request(a, f"{name}.{i}", op, prescale_factor,
                                                  postscale_factor, ps), [a]))
             for i, a in enumerate(arrays)]
    return _GroupHandle(name, parts, len(arrays))


def grouped_reducescatter(arrays: Sequence[ArrayLike], op: Optional[int] = None,
                          name: Optional[str] = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0,
                          process_set: Optional[ProcessSet] = None) -> list[np.ndarray]:
    """Reducescatter each array of a list; returns the list of results."""
    return wait_now(lambda: grouped_reducescatter_async(arrays, op, name, prescale_factor,
                                                   postscale_factor, process_set))


def barrier_async(name: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> Handle:
    """Start a barrier: its handle completes once every rank of ``process_set`` (default: the
    job) has started one; ``synchronize(handle)`` waits for it."""
    ps = member_set_id(process_set, "barrier")
    req = Request(_name(BARRIER, name, ps), BARRIER, "", ((),), -1, -1, 1.0, 1.0, None, ps)
    return _submit(req, [])


def barrier(name: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> None:
    """Return once every rank (of ``process_set``) has called barrier()."""
    wait_now(lambda: barrier_async(name, process_set))


def join() -> int:
    """This rank has no more data: until every rank has joined, it takes part in the other
    ranks' allreduces with zeros.  Returns the rank that joined last (on every rank).

    Once every rank has joined, automatic names count from 0 again on every rank, so the
    unnamed collectives that follow agree on their names whatever each rank did before."""
    last = wait_now(lambda: _submit(Request("join", JOIN, "", ((),), -1, -1, 1.0, 1.0, None),
                                    []))
    _restart_names()
    return last
