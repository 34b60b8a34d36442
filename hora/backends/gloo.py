"""Collectives through torch.distributed's gloo backend (``HORA_BACKEND=gloo``).

One gloo process group over every rank of the job, built directly (no
``init_process_group``: the user's own ``torch.distributed`` default group stays theirs).
Gloo meets through a TCPStore: rank 0 serves it on a free port and sends the port over
hora's own transport; every other rank dials rank 0 at the address its hora connection to
rank 0 already uses, and gloo listens on the address hora's connections use locally, so
gloo goes where hora's TCP goes (HORA_IFACE included).

The engine's flat numpy buffers become tensors with ``torch.from_numpy`` (no copy).  A call
returns False where gloo cannot serve it (a dtype gloo lacks: int16, unsigned beyond uint8,
bool, complex; an op it lacks), and the engine runs its TCP algorithms instead; every rank
decides alike, since they all see the same dtype and op.  Allgather pads every block to the
largest (gloo gathers equal blocks); reduce-scatter and alltoall take uneven blocks as they
are.

Layer: backends.  Knows nothing of names or requests; imports torch lazily (``hora[torch]``).
"""
import datetime
import logging
import struct

import numpy as np

from ..errors import HoraError, HoraInternalError, TransportBrokenError
from .ring import segment_bounds

__all__ = ["DTYPES", "GlooGroup", "gloo_group", "meet_store", "raise_failure", "reduce_ops",
           "require_torch", "shut_down"]

log = logging.getLogger(__name__)

_PORT = struct.Struct("!I")
# numpy dtypes gloo reduces and moves as themselves (torch 2.13: GENERATE_ALL_TYPES)
DTYPES = frozenset(np.dtype(d) for d in
                    ("float16", "float32", "float64", "int8", "uint8", "int32", "int64"))


def require_torch(what="HORA_BACKEND=gloo"):
    """Import torch.distributed with gloo, or raise HoraError naming the extra to install."""
    try:
        import torch.distributed as dist
    except ImportError as e:
        raise HoraError(f"{what} needs PyTorch: pip install 'hora[torch]'") from e
    if not dist.is_available() or not dist.is_gloo_available():
        raise HoraError(f"{what}: this PyTorch build has no gloo backend "
                        f"(torch.distributed.is_gloo_available() is False)")
    return dist


def meet_store(dist, t, timeout):
    """A TCPStore for every rank of transport ``t``: rank 0 serves it on a free port and
    tells every rank the port over ``t`` (0: it could not); the others connect to rank 0's
    address on their hora connection.  Collective: every rank calls it at the same point."""
    peers = range(1, t.size)
    if t.rank == 0:
        store, error = None, None
        try:
            store = dist.TCPStore("0.0.0.0", 0, t.size, True, timeout, wait_for_workers=False)
        except (RuntimeError, OSError) as e:
            error = e
        port = memoryview(_PORT.pack(store.port if store is not None else 0))
        t.exchange([(p, port) for p in peers], [])
        if store is None:
            raise HoraError(f"rank 0 could not serve torch.distributed's TCPStore: {error}")
        return store
    got = bytearray(_PORT.size)
    t.exchange([], [(0, memoryview(got))])
    (port,) = _PORT.unpack(got)
    if port == 0:
        raise HoraError("rank 0 could not serve torch.distributed's TCPStore (see rank 0's log)")
    host = t.addresses(0)[1]
    try:
        return dist.TCPStore(host, port, t.size, False, timeout)
    except (RuntimeError, OSError) as e:
        raise HoraError(f"rank {t.rank} could not reach torch.distributed's TCPStore at rank 0 "
                        f"({host}:{port}): {e}") from e


def reduce_ops(dist):
    """The engine's reduce functions -> torch.distributed's ReduceOps."""
    return {np.add: dist.ReduceOp.SUM, np.multiply: dist.ReduceOp.PRODUCT,
            np.minimum: dist.ReduceOp.MIN, np.maximum: dist.ReduceOp.MAX}


def gloo_group(dist, store, t, timeout, prefix="hora/gloo"):
    """A ProcessGroupGloo of every rank of ``t``, meeting in ``store`` under ``prefix`` and
    listening on the address hora's own connections use here."""
    local = t.addresses(1 if t.rank == 0 else 0)[0]
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local)]
    options._timeout = datetime.timedelta(seconds=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), t.rank, t.size, options)


def raise_failure(t, what, e):
    """A torch.distributed call failed with ``e``: raise TransportBrokenError naming the dead
    peer if hora's own connections saw it go, else HoraInternalError."""
    try:
        t.watch(timeout=1.0)
    except TransportBrokenError as lost:
        raise lost from e
    raise HoraInternalError(f"rank {t.rank}: {what} failed: {e}") from e


def shut_down(pg, label):
    """Shut process group ``pg`` down (None: nothing to do); a failure is only logged."""
    if pg is not None:
        try:
            pg.shutdown()
        except RuntimeError as e:
            log.debug("%s shutdown: %s", label, e)


class GlooGroup:
    """A gloo process group over every rank of transport ``t`` (see the module docstring):
    a :class:`~hora.backends.base.Plane`.

    Collective: every rank constructs it at the same point.

    Args:
        t: the job's connected :class:`~hora.backends.base.NetworkTransport`.
        start_timeout: seconds for every rank to join the group.
        timeout: seconds one gloo collective may take before it fails.
    """

    name = "gloo"      # how the timeline and the metrics call this plane

    def __init__(self, t, start_timeout=30.0, timeout=300.0):
        dist = require_torch()
        import torch
        self._torch, self._dist, self._t = torch, dist, t
        self.rank, self.size = t.rank, t.size
        self._ops = reduce_ops(dist)
        self._store = meet_store(dist, t, datetime.timedelta(seconds=start_timeout))
        try:
            self._pg = gloo_group(dist, self._store, t, timeout)
        except RuntimeError as e:
            self._failed("joining the group", e)

    def _failed(self, what, e):
        raise_failure(self._t, f"gloo {what}", e)

    def _run(self, what, start):
        try:
            start().wait()
        except RuntimeError as e:
            self._failed(what, e)
        return True

    def _tensor(self, arr):
        return self._torch.from_numpy(arr)

    # -- collectives (flat, contiguous arrays; every rank calls with the same dtype) ------
    def allreduce(self, flat, reduce_fn):
        op = self._ops.get(reduce_fn)
        if flat.dtype not in DTYPES or op is None:
            return False
        if flat.size == 0:
            return True
        opts = self._dist.AllreduceOptions()
        opts.reduceOp = op
        return self._run("allreduce", lambda: self._pg.allreduce([self._tensor(flat)], opts))

    def broadcast(self, flat, root):
        if flat.dtype not in DTYPES:
            return False
        if flat.size == 0:
            return True
        opts = self._dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        return self._run("broadcast", lambda: self._pg.broadcast([self._tensor(flat)], opts))

    def allgather(self, out, counts):
        if out.dtype not in DTYPES:
            return False
        if out.size == 0:
            return True
        bounds, width = segment_bounds(counts), max(counts)
        mine = np.zeros(width, dtype=out.dtype)
        mine[:counts[self.rank]] = out[bounds[self.rank]:bounds[self.rank + 1]]
        even = all(c == width for c in counts)
        gathered = out if even else np.empty(width * self.size, dtype=out.dtype)
        self._run("allgather", lambda: self._pg._allgather_base(self._tensor(gathered),
                                                                self._tensor(mine)))
        if not even:
            for p in range(self.size):
                out[bounds[p]:bounds[p + 1]] = gathered[p * width:p * width + counts[p]]
        return True

    def reducescatter(self, flat, counts, reduce_fn):
        op = self._ops.get(reduce_fn)
        if flat.dtype not in DTYPES or op is None:
            return False
        if flat.size == 0:
            return True
        bounds = segment_bounds(counts)
        blocks = [self._tensor(flat[bounds[p]:bounds[p + 1]]) for p in range(self.size)]
        mine = np.empty(counts[self.rank], dtype=flat.dtype)
        opts = self._dist.ReduceScatterOptions()
        opts.reduceOp = op
        self._run("reducescatter",
                  lambda: self._pg.reduce_scatter([self._tensor(mine)], [blocks], opts))
        flat[bounds[self.rank]:bounds[self.rank + 1]] = mine
        return True

    def alltoall(self, send, send_counts, recv, recv_counts):
        """Send block p of ``send`` (``send_counts``) to rank p; receive rank p's block for
        us into block p of ``recv`` (``recv_counts``).  Sizes differ per rank."""
        if send.dtype not in DTYPES:
            return False
        return self._run("alltoall", lambda: self._pg.alltoall_base(
            self._tensor(recv), self._tensor(send), [int(c) for c in recv_counts],
            [int(c) for c in send_counts], self._dist.AllToAllOptions()))

    def close(self):
        """Leave the group (local: every rank has passed its last collective)."""
        shut_down(getattr(self, "_pg", None), "gloo")
        self._pg = self._store = None
