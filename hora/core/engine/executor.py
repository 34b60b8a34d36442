"""Runs what the coordinator decided: every rank runs the same responses in the same order.

:class:`Executor` holds this rank's collectives that wait for their answer (``pending``),
and runs each response (:mod:`hora.core.wire`): a ``Run`` on the transport (the global set's
large collectives on the data plane, :mod:`hora.core.dataplane`; device arrays on their
device plane), a ``Value`` by copying out rank 0's result, an ``Error`` by failing the
handles.  It keeps the engine's record of the process sets, changed only by the ADD_SET and
REMOVE_SET responses as they run, so that each collective runs among the members the
coordinator decided when it ordered it.

The numpy side of the allreduce (fusing the arrays into one buffer, Horovod's scaling rule,
reusable buffers) is here too: :func:`scale`, :func:`prescaled`, :func:`reusable`.

Layer: core.
"""
import numpy as np

from ...backends import ring
from ...backends.group import SubsetTransport
from ...errors import CollectiveAbortedError, CollectiveMismatchError, HoraShutdownError
from ..messages import (ADD_SET, ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, JOIN,
                        REDUCESCATTER, REMOVE_SET, Average, Max, Min, Product, Sum)
from ..wire import Cache, Error, Run, Shutdown, Tune, Value

__all__ = ["Executor", "REDUCE", "scale", "prescaled", "reusable"]

REDUCE = {Sum: np.add, Average: np.add, Min: np.minimum, Max: np.maximum, Product: np.multiply}


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
        self._scratch = {}
        self._fusion = {}

    def run_all(self, responses):
        """Run ``responses`` in order; True when one says the job is over."""
        for resp in responses:
            cls = resp.__class__
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
        for name in names:
            entry = self.pending.pop((set_id, name), None)
            if entry is None:
                continue
            if why == "aborted":
                error = CollectiveAbortedError(message, detail)
            elif why == "mismatch":
                error = CollectiveMismatchError(message)
            else:
                error = HoraShutdownError(message)
            self._finish(entry[0], entry[2], error=error)

    def _take_values(self, set_id, names, results):
        if self.tuning:
            self.tuned_bytes += sum(len(b) for b in results)
        for name, blob in zip(names, results):
            entry = self.pending.pop((set_id, name), None)
            if entry is None:
                continue
            req, arrays, handle = entry
            flat = np.frombuffer(blob, dtype=np.dtype(req.dtype))
            outs, offset = [], 0
            for a in arrays:
                part = flat[offset:offset + a.size].reshape(a.shape)
                offset += a.size
                if handle.inplace:
                    a[...] = part
                    outs.append(a)
                else:
                    outs.append(part.copy())
            self._finish(req, handle, outs)

    def _execute(self, resp):
        kind, set_id, names, extra = resp.kind, resp.set_id, resp.names, resp.extra
        if kind == ADD_SET:
            self.sets[extra.set_id] = extra.ranks
            results = [extra.set_id]
        elif kind == REMOVE_SET:
            self.sets.pop(extra, None)
            results = [extra]
        elif kind == JOIN:
            results = [extra]
            set_id = 0
        members = self.sets.get(set_id, ())
        if self.rank not in members:
            return                          # a collective of a process set we are not in
        t = self._t if set_id == 0 else SubsetTransport(self._t, members)
        entries = [self.pending.pop((set_id, name), None) for name in names]
        if kind == ALLREDUCE:
            if entries[0] is None:          # this rank has joined: contribute zeros
                req = extra.request
                if req.device:
                    zeros = self.device_planes[req.device].zeros(req.shapes, req.dtype)
                else:
                    zeros = [np.zeros(s, dtype=req.dtype) for s in req.shapes]
                self._allreduce(t, [(req, zeros, None)])
                return
            results = self._allreduce(t, entries)
        elif kind == BARRIER:
            results = [None]
        elif kind in (ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER):
            req, arrays, _ = entries[0]
            run = {ALLGATHER: self._allgather, BROADCAST: self._broadcast,
                   ALLTOALL: self._alltoall, REDUCESCATTER: self._reducescatter}[kind]
            results = [run(t, req, arrays[0], extra)]
        for entry, result in zip(entries, results):
            if entry is not None:
                self._finish(entry[0], entry[2], result)

    def _allreduce(self, t, entries):
        req = entries[0][0]
        dtype = np.dtype(req.dtype)
        arrays = [a for _, arrs, _ in entries for a in arrs]
        # in place (``allreduce_``): results go back into the callers' arrays, so the buffer
        # can be the array itself or the reusable fusion buffer, never a fresh allocation
        inplace = all(h is not None and h.inplace for _, _, h in entries)
        if req.device:
            return self._device_allreduce(req, entries, arrays, inplace)
        total = sum(a.size for a in arrays)
        if len(arrays) == 1 and inplace and arrays[0].flags.c_contiguous:
            buf = arrays[0].reshape(-1)
        elif len(arrays) == 1:
            buf = np.array(arrays[0], dtype=dtype, copy=True, order="C").reshape(-1)
        else:
            buf = reusable(self._fusion, dtype, total) if inplace else np.empty(total, dtype=dtype)
            np.concatenate([a.reshape(-1) for a in arrays], out=buf, casting="unsafe")
        scale(buf, req.prescale, 1)
        if self.tuning:
            self.tuned_bytes += buf.nbytes
        reduce_fn = REDUCE[req.op]
        if total and not (self._use_plane(t, buf) and self._plane.allreduce(buf, reduce_fn)):
            ring.allreduce(t, buf, reduce_fn, reusable(self._scratch, dtype, -(-total // t.size)))
        scale(buf, req.postscale, t.size if req.op == Average else 1)
        # several arrays were packed into a buffer of their own: no array shares its memory
        fused = len(arrays) > 1
        results, offset = [], 0
        for _, arrs, _ in entries:
            outs = []
            for a in arrs:
                part = buf[offset:offset + a.size].reshape(a.shape)
                if inplace:
                    if fused or not np.shares_memory(a, buf):
                        np.copyto(a, part)
                    part = a
                outs.append(part)
                offset += a.size
            results.append(outs)
        return results

    def _use_plane(self, t, buf):
        return self._plane is not None and t is self._t and buf.nbytes > ring.SMALL

    def _device_allreduce(self, req, entries, arrays, inplace):
        """Device arrays (global set only): the device plane fuses, reduces and scales them
        where they live."""
        if self.tuning:
            self.tuned_bytes += sum(a.size for a in arrays) * np.dtype(req.dtype).itemsize
        outs = self.device_planes[req.device].allreduce(
            arrays, REDUCE[req.op], req.prescale, req.postscale,
            self.size if req.op == Average else 1, inplace)
        results, offset = [], 0
        for _, arrs, _ in entries:
            results.append(outs[offset:offset + len(arrs)])
            offset += len(arrs)
        return results

    def _allgather(self, t, req, array, dims):
        if req.device:
            return self.device_planes[req.device].allgather(array, dims)
        a = np.ascontiguousarray(array).reshape(-1)
        shape = array.shape if array.ndim else (1,)
        row = int(np.prod(shape[1:], dtype=np.int64))
        counts = [d * row for d in dims]
        bounds = ring.segment_bounds(counts)
        out = np.empty(bounds[-1], dtype=array.dtype)
        out[bounds[t.rank]:bounds[t.rank + 1]] = a
        if not (self._use_plane(t, out) and self._plane.allgather(out, counts)):
            ring.allgather(t, out, counts)
        return out.reshape((sum(dims),) + tuple(shape[1:]))

    def _broadcast(self, t, req, array, _):
        if req.device:
            return self.device_planes[req.device].broadcast(array, req.root)
        buf = np.array(array, copy=True, order="C").reshape(-1)
        root = req.root if t is self._t else self.sets[req.process_set].index(req.root)
        if not (self._use_plane(t, buf) and self._plane.broadcast(buf, root)):
            ring.broadcast(t, buf, root)
        return buf.reshape(array.shape)

    def _alltoall(self, t, req, array, splits):
        shape = array.shape if array.ndim else (1,)
        row = int(np.prod(shape[1:], dtype=np.int64))
        send = np.ascontiguousarray(array).reshape(-1)
        recv_rows = [splits[j][t.rank] for j in range(t.size)]
        send_counts = [s * row for s in splits[t.rank]]
        recv = np.empty(sum(recv_rows) * row, dtype=array.dtype)
        recv_counts = [s * row for s in recv_rows]
        plane_alltoall = getattr(self._plane, "alltoall", None) if t is self._t else None
        if not (plane_alltoall and plane_alltoall(send, send_counts, recv, recv_counts)):
            ring.alltoall(t, send, send_counts, recv, recv_counts)
        return (recv.reshape((sum(recv_rows),) + tuple(shape[1:])),
                np.array(recv_rows, dtype=np.int32))

    def _reducescatter(self, t, req, array, _):
        shape = array.shape if array.ndim else (1,)
        row = int(np.prod(shape[1:], dtype=np.int64))
        rows = ring.even_counts(shape[0], t.size)
        counts = [r * row for r in rows]
        buf = np.array(array, copy=True, order="C").reshape(-1)
        scale(buf, req.prescale, 1)
        if self.tuning:
            self.tuned_bytes += buf.nbytes
        reduce_fn = REDUCE[req.op]
        if not (self._use_plane(t, buf) and self._plane.reducescatter(buf, counts, reduce_fn)):
            ring.reducescatter(t, buf, counts, reduce_fn,
                               reusable(self._scratch, buf.dtype, max(counts)))
        bounds = ring.segment_bounds(counts)
        mine = buf[bounds[t.rank]:bounds[t.rank + 1]].copy()
        scale(mine, req.postscale, t.size if req.op == Average else 1)
        return mine.reshape((rows[t.rank],) + tuple(shape[1:]))


def prescaled(req, arrays):
    """The request's arrays, flattened into one buffer of its dtype, times its prescale."""
    if len(arrays) == 1 and req.prescale == 1:
        return np.ascontiguousarray(arrays[0], dtype=req.dtype).tobytes()
    if len(arrays) == 1:
        buf = np.array(arrays[0], dtype=req.dtype, copy=True, order="C").reshape(-1)
    else:
        buf = np.concatenate([np.asarray(a, dtype=req.dtype).reshape(-1) for a in arrays])
    scale(buf, req.prescale, 1)
    return buf.tobytes()


def reusable(pool, dtype, n):
    """``n`` elements of the buffer kept in ``pool`` for ``dtype``, grown when too small."""
    buf = pool.get(dtype)
    if buf is None or buf.size < n:
        buf = pool[dtype] = np.empty(max(n, 1), dtype=dtype)
    return buf[:n]


def scale(buf, factor, divisor):
    """buf *= factor / divisor, in place, rounded as Horovod's CPU scaling rounds.

    The two make one factor, computed in double precision (Horovod folds an average into
    the postscale factor the same way).  float16 is multiplied in float32 and rounded back
    to the nearest float16; float32 by the factor rounded to float32; float64 (and complex)
    in their own precision; integers in float64, truncated toward zero as a C cast does.
    So hora's scaled results equal Horovod's bit for bit, not only to the last place.
    """
    by = float(factor) / divisor
    if by == 1:
        return
    if buf.dtype == np.float16:
        buf[...] = np.multiply(buf, np.float32(by), dtype=np.float32)
    elif buf.dtype == np.float32:
        np.multiply(buf, np.float32(by), out=buf)
    elif buf.dtype.kind in "fc":
        np.multiply(buf, by, out=buf, casting="unsafe")
    else:
        buf[...] = np.trunc(buf.astype(np.float64) * by).astype(buf.dtype)
