"""Runs what the coordinator decided: every rank runs the same responses in the same order.

:class:`Executor` holds this rank's collectives that wait for their answer (``pending``),
and runs each response (:mod:`hora.core.wire`): a ``Run`` on the transport (the global set's
large collectives on the data plane, :mod:`hora.core.dataplane`; device arrays on their
device plane), a ``Value`` by copying out rank 0's result, an ``Error`` by failing the
handles.  It keeps the engine's record of the process sets, changed only by the ADD_SET and
REMOVE_SET responses as they run, so that each collective runs among the members the
coordinator decided when it ordered it.

Every collective runs on a plane (:class:`hora.backends.base.Plane`): the global set's data
plane for its large collectives when it takes them, else the TCP ring of the process set
(:class:`hora.backends.ring.RingPlane`).  An allreduce's arrays are fused into one buffer and
scaled by :mod:`hora.core.fusion`, on the host or, for device arrays, on their device plane's
device.

Layer: core.
"""
import time

import numpy as np

from ...backends import ring
from ...backends.group import SubsetTransport
from ...backends.ring import RingPlane
from ...errors import (CollectiveAbortedError, CollectiveMismatchError, HoraInternalError,
                       HoraShutdownError, InvalidArgumentError)
from .. import stats, timeline
from ..messages import (ADD_SET, ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, JOIN,
                        KIND_NAMES, REDUCESCATTER, REMOVE_SET, Average)
from ..fusion import NUMPY, Fusion, scale
from ..wire import Cache, Error, Run, Shutdown, Tune, Value
from .folds import REDUCE

__all__ = ["Executor", "count_collective", "count_reduced", "results_of"]

_MOVES_DATA = frozenset((ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER))


class Executor:
    """Runs responses on one rank.

    Args:
        rank, size: this rank, and the job's size.
        transport: the connected transport of the global set.
        release: ``release((set, name))``, called when a collective finishes (its name may
            be used again).
        plane: the data plane of the global set's large collectives, or None (the TCP
            algorithms of :mod:`hora.backends.ring`).
        device_planes: ``{device type: plane}`` for collectives of device arrays.
        on_tune: ``on_tune(cycle_ms)``, for a ``Tune`` response.

    Attributes:
        pending: ``(set, name) -> (request, arrays, handle)`` of this rank's collectives
            that wait for their answer.
        cache_ids: request -> its id in the coordinator's response cache.
        sets: process set id -> its global ranks, as the responses run so far made them.
        tuning: count the allreduce bytes run in ``tuned_bytes`` (rank 0, autotune).
    """

    def __init__(self, rank, size, transport, release, plane=None, device_planes=None,
                 on_tune=None):
        self.rank = rank
        self.size = size
        self._t = transport
        self._release = release
        self._plane = plane
        self.device_planes = device_planes or {}
        self._on_tune = on_tune
        self.pending = {}
        self.cache_ids = {}
        self.sets = {0: tuple(range(size))}
        self.tuning = False
        self.tuned_bytes = 0
        self._scratch = {}                  # the rings' reduction buffers, by dtype
        self._rings = {}                    # set id -> (its transport view, its RingPlane)
        self._host = Fusion(NUMPY)
        self._device = {}                   # device type -> Fusion of its device plane

    def run_all(self, responses):
        """Run ``responses`` in order; True when one says the job is over."""
        rec = timeline._recorder
        sent = stats.counters.sent
        for resp in responses:
            cls = resp.__class__
            if cls is Run or cls is Value or cls is Error:
                now = time.monotonic()
                c = stats.counters
                for name in resp.names:
                    key = (resp.set_id, name)
                    start = sent.pop(key, None)
                    if start is not None:
                        c.negotiations += 1
                        c.negotiation_s += now - start
                    if rec is not None:
                        rec.answered(key, now)
            if cls is Run:
                self._execute(resp)
            elif cls is Value:
                self._take_values(resp.set_id, resp.names, resp.results)
            elif cls is Error:
                self._reject(resp.set_id, resp.names, resp.message, resp.why, resp.detail)
            elif cls is Cache:
                self.cache_ids[resp.request] = resp.cache_id
            elif cls is Tune:
                self._on_tune(resp.cycle_ms)
            elif cls is Shutdown:
                return True
        return False

    def _finish(self, req, handle, result=None, error=None):
        self._release((req.process_set, req.name))
        if error is not None:
            handle._set_error(error)
        else:
            handle._set_result(result)

    def _reject(self, set_id, names, message, why, detail=None):
        if why == "nonmember" and self.rank not in (detail or {}):
            return                          # a member's collective of the name goes on
        for name in names:
            entry = self.pending.pop((set_id, name), None)
            if entry is None:
                continue
            if why == "aborted":
                error = CollectiveAbortedError(message, detail)
            elif why == "mismatch":
                error = CollectiveMismatchError(message)
            elif why == "nonmember":
                error = InvalidArgumentError(message)
            else:
                error = HoraShutdownError(message)
            self._finish(entry[0], entry[2], error=error)

    def _take_values(self, set_id, names, results):
        if self.tuning:
            self.tuned_bytes += sum(len(b) for b in results)
        rec = timeline._recorder
        for name, blob in zip(names, results):
            entry = self.pending.pop((set_id, name), None)
            if entry is None:
                continue
            start = time.monotonic() if rec is not None else 0.0
            count_reduced(len(blob), "rank 0", name)
            req, arrays, handle = entry
            flat = np.frombuffer(blob, dtype=np.dtype(req.dtype))
            self._finish(req, handle, results_of(flat, arrays, handle.inplace))
            if rec is not None:     # (rank 0 reduced it: this rank copies the result out)
                rec.span(name, "ALLREDUCE rank 0", start, time.monotonic(), {"bytes": len(blob)})

    def _execute(self, resp):
        kind, set_id, names, extra = resp.kind, resp.set_id, resp.names, resp.extra
        results = [None]                    # (a barrier's)
        if kind == ADD_SET:
            self.sets[extra.set_id] = extra.ranks
            results = [extra.set_id]
        elif kind == REMOVE_SET:
            self.sets.pop(extra, None)
            self._rings.pop(extra, None)
            results = [extra]
        elif kind == JOIN:
            results = [extra]
            set_id = 0
        members = self.sets.get(set_id, ())
        if self.rank not in members:
            return                          # a collective of a process set we are not in
        t, ringp = self._ring(set_id, members)
        entries = [self.pending.pop((set_id, name), None) for name in names]
        try:
            if kind in _MOVES_DATA:
                results = self._run(kind, t, ringp, entries, extra)
        except BaseException:
            # back among the pending, which the engine's failure fails at once (a handle
            # out of them would wait for its waiter's next look at the engine: up to 1 s)
            for name, entry in zip(names, entries):
                if entry is not None:
                    self.pending[(set_id, name)] = entry
            raise
        if results is None:
            return
        c = stats.counters
        c.last_op = (KIND_NAMES[kind], names[0])
        rec = timeline._recorder
        if rec is not None and kind not in _MOVES_DATA:    # (rank 0's answer was the operation)
            now = time.monotonic()
            for name, entry in zip(names, entries):
                if entry is not None:
                    rec.span(name, KIND_NAMES[kind].upper(), now, now)
        for entry, result in zip(entries, results):
            if entry is not None:
                c.collectives[KIND_NAMES[kind]] += 1
                if kind != ALLREDUCE and entry[1]:
                    c.bytes[KIND_NAMES[kind]] += int(getattr(entry[1][0], "nbytes", 0))
                self._finish(entry[0], entry[2], result)

    def _run(self, kind, t, ringp, entries, extra):
        """Run one collective of :data:`_MOVES_DATA` on the ``entries`` (None where this
        rank has joined); its results, one per entry (None: nothing to hand back)."""
        if kind == ALLREDUCE:
            if entries[0] is None:          # this rank has joined: contribute zeros
                if extra is None:
                    raise HoraInternalError("an allreduce ran that this rank neither "
                                            "submitted nor joined")
                req = extra.request
                if req.device:
                    zeros = self.device_planes[req.device].zeros(req.shapes, req.dtype)
                else:
                    zeros = [np.zeros(s, dtype=req.dtype) for s in req.shapes]
                self._allreduce(t, ringp, [(req, zeros, None)])
                return None
            return self._allreduce(t, ringp, entries)
        req, arrays, _ = entries[0]
        run = {ALLGATHER: self._allgather, BROADCAST: self._broadcast,
               ALLTOALL: self._alltoall, REDUCESCATTER: self._reducescatter}[kind]
        rec = timeline._recorder
        start = time.monotonic() if rec is not None else 0.0
        results = [run(t, ringp, req, arrays[0], extra)]
        if rec is not None:
            rec.span(req.name, KIND_NAMES[kind].upper(), start, time.monotonic(),
                     {"bytes": int(arrays[0].nbytes)})
        return results

    def _ring(self, set_id, members):
        """The transport of a process set (a view of the job's for a subset) and its ring."""
        got = self._rings.get(set_id)
        if got is None:
            t = self._t if set_id == 0 else SubsetTransport(self._t, members)
            got = self._rings[set_id] = (t, RingPlane(t, self._scratch))
        return got

    def _data_plane(self, t, nbytes):
        """The data plane for a collective of ``nbytes`` on ``t``, or None: the ring's."""
        return self._plane if t is self._t and nbytes > ring.SMALL else None

    def _allreduce(self, t, ringp, entries):
        req = entries[0][0]
        arrays = [a for _, arrs, _ in entries for a in arrs]
        # in place (``allreduce_``): results go back into the callers' arrays, so the buffer
        # can be the array itself or the reusable fusion buffer, never a fresh allocation
        inplace = all(h is not None and h.inplace for _, _, h in entries)
        rec = timeline._recorder
        start = time.monotonic() if rec is not None else 0.0
        if req.device:
            out = self._device_allreduce(req, arrays, inplace)
            if rec is not None:
                _trace(rec, entries, ((f"ALLREDUCE {req.device}", start, time.monotonic()),),
                       sum(int(getattr(a, "nbytes", 0)) for a in arrays))
            return _per_entry(entries, out)
        buf = self._host.pack(arrays, np.dtype(req.dtype), inplace)
        scale(buf, req.prescale, 1)
        if self.tuning:
            self.tuned_bytes += buf.nbytes
        packed = time.monotonic() if rec is not None else 0.0
        reduce_fn = REDUCE[req.op]
        used = "tcp"
        if buf.size:
            plane = self._data_plane(t, buf.nbytes)
            if plane is None or not plane.allreduce(buf, reduce_fn):
                ringp.allreduce(buf, reduce_fn)
            else:
                used = plane.name
        reduced = time.monotonic() if rec is not None else 0.0
        c = stats.counters
        c.planes[used] += 1
        c.plane = used
        c.fused_buffers += 1
        c.fused_tensors += len(entries)
        c.fused_bytes += buf.nbytes
        c.bytes["allreduce"] += buf.nbytes
        scale(buf, req.postscale, t.size if req.op == Average else 1)
        out = self._host.unpack(buf, arrays, inplace)
        if rec is not None:
            _trace(rec, entries, (("PACK", start, packed), (f"ALLREDUCE {used}", packed, reduced),
                                  ("UNPACK", reduced, time.monotonic())), buf.nbytes)
        return _per_entry(entries, out)

    def _device_allreduce(self, req, arrays, inplace):
        """Device arrays (global set only): fused, reduced and scaled where they live, on
        their device plane."""
        plane = self.device_planes[req.device]
        fusion = self._device.get(req.device)
        if fusion is None:
            fusion = self._device[req.device] = Fusion(plane.ops)
        ops = fusion.ops
        tensors = [a.tensor for a in arrays]
        with plane.on(arrays):
            buf = fusion.pack(tensors, ops.dtype_of(tensors[0]), inplace)
            if self.tuning:
                self.tuned_bytes += ops.numel(buf) * np.dtype(req.dtype).itemsize
            ops.scale(buf, req.prescale, 1)
            if ops.numel(buf):
                plane.allreduce(buf, REDUCE[req.op])
            ops.scale(buf, req.postscale, self.size if req.op == Average else 1)
            return fusion.unpack(buf, tensors, inplace)

    def close(self):
        """Let go of the fusion buffers (device memory among them)."""
        self._host.clear()
        for fusion in self._device.values():
            fusion.clear()
        self._rings.clear()
        self._scratch.clear()

    def _allgather(self, t, ringp, req, array, dims):
        if req.device:
            return self.device_planes[req.device].allgather(array, dims)
        a = np.ascontiguousarray(array).reshape(-1)
        shape = array.shape if array.ndim else (1,)
        row = int(np.prod(shape[1:], dtype=np.int64))
        counts = [d * row for d in dims]
        bounds = ring.segment_bounds(counts)
        out = np.empty(bounds[-1], dtype=array.dtype)
        out[bounds[t.rank]:bounds[t.rank + 1]] = a
        plane = self._data_plane(t, out.nbytes)
        if plane is None or not plane.allgather(out, counts):
            ringp.allgather(out, counts)
        return out.reshape((sum(dims),) + tuple(shape[1:]))

    def _broadcast(self, t, ringp, req, array, _):
        if req.device:
            return self.device_planes[req.device].broadcast(array, req.root)
        buf = np.array(array, copy=True, order="C").reshape(-1)
        root = req.root if t is self._t else self.sets[req.process_set].index(req.root)
        plane = self._data_plane(t, buf.nbytes)
        if plane is None or not plane.broadcast(buf, root):
            ringp.broadcast(buf, root)
        return buf.reshape(array.shape)

    def _alltoall(self, t, ringp, req, array, splits):
        shape = array.shape if array.ndim else (1,)
        row = int(np.prod(shape[1:], dtype=np.int64))
        send = np.ascontiguousarray(array).reshape(-1)
        recv_rows = [splits[j][t.rank] for j in range(t.size)]
        send_counts = [s * row for s in splits[t.rank]]
        recv = np.empty(sum(recv_rows) * row, dtype=array.dtype)
        recv_counts = [s * row for s in recv_rows]
        plane = self._plane if t is self._t else None
        if plane is None or not plane.alltoall(send, send_counts, recv, recv_counts):
            ringp.alltoall(send, send_counts, recv, recv_counts)
        return (recv.reshape((sum(recv_rows),) + tuple(shape[1:])),
                np.array(recv_rows, dtype=np.int32))

    def _reducescatter(self, t, ringp, req, array, _):
        shape = array.shape if array.ndim else (1,)
        row = int(np.prod(shape[1:], dtype=np.int64))
        rows = ring.even_counts(shape[0], t.size)
        counts = [r * row for r in rows]
        buf = np.array(array, copy=True, order="C").reshape(-1)
        scale(buf, req.prescale, 1)
        if self.tuning:
            self.tuned_bytes += buf.nbytes
        reduce_fn = REDUCE[req.op]
        plane = self._data_plane(t, buf.nbytes)
        if plane is None or not plane.reducescatter(buf, counts, reduce_fn):
            ringp.reducescatter(buf, counts, reduce_fn)
        bounds = ring.segment_bounds(counts)
        mine = buf[bounds[t.rank]:bounds[t.rank + 1]].copy()
        scale(mine, req.postscale, t.size if req.op == Average else 1)
        return mine.reshape((rows[t.rank],) + tuple(shape[1:]))


def results_of(flat, arrays, inplace):
    """The results of ``arrays`` from ``flat``, their reduced values one after another:
    written into the arrays themselves when ``inplace``, else copies (``flat`` is a message's
    bytes or the board's result area, not the caller's to keep)."""
    outs, offset = [], 0
    for a in arrays:
        part = flat[offset:offset + a.size].reshape(a.shape)
        offset += a.size
        if inplace:
            a[...] = part
            outs.append(a)
        else:
            outs.append(part.copy())
    return outs


def count_collective(kind, name, nbytes=None):
    """The metrics of a collective other than an allreduce settled outside the executor (on
    the board), as the executor counts one: ``nbytes`` of input, if it has any."""
    c = stats.counters
    c.collectives[KIND_NAMES[kind]] += 1
    if nbytes is not None:
        c.bytes[KIND_NAMES[kind]] += nbytes
    c.last_op = (KIND_NAMES[kind], name)


def count_reduced(nbytes, plane, name):
    """The metrics of an allreduce of ``nbytes`` reduced outside the data planes (``plane``:
    "rank 0", or "board")."""
    c = stats.counters
    c.collectives["allreduce"] += 1
    c.bytes["allreduce"] += nbytes
    c.planes[plane] += 1
    c.plane = plane
    c.last_op = ("allreduce", name)


def _trace(rec, entries, phases, nbytes):
    """The timeline: ``phases`` ``(name, start, end)`` of a (fused) allreduce, on the row of
    each of its collectives; the fused buffer's bytes and the count fused go in the args."""
    args = {"bytes": int(nbytes), "fused": len(entries)}
    for req, _, handle in entries:
        if handle is None:
            continue                # zeros for a rank that has joined
        for phase, start, end in phases:
            rec.span(req.name, phase, start, end, args)


def _per_entry(entries, outs):
    """The results ``outs`` of the entries' arrays, in order, as one list per entry."""
    if len(entries) == 1:
        return [outs]
    results, offset = [], 0
    for _, arrs, _ in entries:
        results.append(outs[offset:offset + len(arrs)])
        offset += len(arrs)
    return results
