"""Collectives on framework tensors where they live: CUDA tensors through NCCL
(``HORA_BACKEND=nccl``), a *device plane*.

The engine negotiates a device collective like any other (the request says where its data
lives, so a rank that passes a host tensor where the others pass CUDA tensors fails them all
with one message), then works on the tensors themselves: the engine fuses an allreduce's
tensors into one buffer on their device (:mod:`hora.core.fusion`, through this plane's
:class:`TorchOps`), this plane runs one torch.distributed collective on it over a process
group of every rank (a ProcessGroupNCCL built directly: the user's own default group stays
theirs), and the engine scales it and writes the results back, never staging through host
memory.  Allreduce, broadcast and
allgather of the global process set come here; the binding stages everything else through
host memory, as it does every CUDA tensor without this plane.

Streams: the binding records a CUDA event on the caller's current stream when it submits a
tensor; this plane makes the current stream of the thread running it wait for that event,
and returns once its work has finished on the device, so a result is ready on any stream.
While it waits it watches hora's own connections: a dead peer raises TransportBrokenError
naming it (and the communicator is aborted) instead of leaving a kernel waiting forever.

The same code runs over gloo on CPU tensors (``device_type="cpu"``): that is how it is tested
on machines without a GPU.

Layer: backends.  Knows nothing of names or requests; imports torch lazily.
"""
import contextlib
import datetime
import logging
import math
import time

import numpy as np

from ..errors import HoraError, HoraInternalError, TransportBrokenError
from .gloo import DTYPES as GLOO_DTYPES
from .gloo import gloo_group, meet_store, raise_failure, reduce_ops, require_torch, shut_down

__all__ = ["DTYPES", "TensorGroup", "require_nccl"]

log = logging.getLogger(__name__)

# what this plane moves as itself: gloo's dtypes, which NCCL has too (the binding stages
# bool, int16 and bfloat16 through host memory)
DTYPES = GLOO_DTYPES
_SPIN_S = 200e-6        # poll the device this long for a result before sleeping between looks
_LOOK_S = 0.001         # ... on hora's connections, which a dead peer wakes


def require_nccl():
    """Import torch.distributed with NCCL and a CUDA device, or raise HoraError saying why."""
    dist = require_torch("HORA_BACKEND=nccl")
    import torch
    if not torch.cuda.is_available():
        raise HoraError("HORA_BACKEND=nccl needs a CUDA device: torch.cuda.is_available() is "
                        "False here (use auto for CPU tensors)")
    if not dist.is_nccl_available():
        raise HoraError("HORA_BACKEND=nccl: this PyTorch build has no NCCL "
                        "(torch.distributed.is_nccl_available() is False)")
    return dist


class _Zeros:
    """A device array made here (a joined rank's zeros): nothing to wait for."""

    __slots__ = ("tensor",)
    ready = None

    def __init__(self, tensor):
        self.tensor = tensor


class TensorGroup:
    """A process group over every rank of transport ``t`` for tensors of ``device_type``
    ("cuda": NCCL; "cpu": gloo).  Collective: every rank constructs it at the same point.

    The engine passes *device arrays* (see :func:`hora.core.ops._device`): objects whose
    ``tensor`` is the framework tensor and ``ready`` a CUDA event to wait for, or None.

    Args:
        t: the job's connected TCP transport.
        device_type: "cuda" or "cpu".
        start_timeout: seconds for every rank to join the group.
        timeout: seconds one collective may take before the process group (and, waiting
            for a GPU, this plane) fails it.
        local_rank: this rank's place on its host; until a tensor has come, a joined rank's
            zeros go to the GPU of that index (the one Horovod's scripts pin).
    """

    name = "nccl"      # how the timeline and the metrics call this plane

    dtypes = DTYPES

    def __init__(self, t, device_type="cuda", start_timeout=30.0, timeout=300.0,
                 local_rank=0):
        self._cuda = device_type == "cuda"
        self._label = "nccl" if self._cuda else "gloo"
        dist = require_nccl() if self._cuda else require_torch(f"{device_type} tensors")
        import torch
        self._torch, self._dist, self._t = torch, dist, t
        self.rank, self.size = t.rank, t.size
        self._timeout = timeout
        self._reduce_ops = reduce_ops(dist)
        self._device = (torch.device("cuda", local_rank % torch.cuda.device_count())
                        if self._cuda else torch.device(device_type))
        self.ops = TorchOps(torch)          # what hora.core.fusion needs of its tensors
        self._store = meet_store(dist, t, datetime.timedelta(seconds=start_timeout))
        try:
            if self._cuda:
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = datetime.timedelta(seconds=timeout)
                self._pg = dist.ProcessGroupNCCL(dist.PrefixStore("hora/nccl", self._store),
                                                 self.rank, self.size, options)
            else:
                self._pg = gloo_group(dist, self._store, t, timeout, f"hora/{device_type}")
        except RuntimeError as e:
            raise_failure(t, f"{self._label}: joining the group", e)

    # -- collectives ---------------------------------------------------------------------------
    def allreduce(self, flat, reduce_fn):
        """Reduce the contiguous 1-D tensor ``flat`` in place with ``reduce_fn``, inside
        :meth:`on` for the arrays it was fused from (the caller fuses and scales them:
        :mod:`hora.core.fusion`, with :attr:`ops`).  Always True: this plane never declines."""
        opts = self._dist.AllreduceOptions()
        opts.reduceOp = self._reduce_ops[reduce_fn]
        self._run("allreduce", lambda: self._pg.allreduce([flat], opts))
        return True

    def broadcast(self, array, root):
        """A new tensor holding rank ``root``'s ``array``."""
        torch = self._torch
        with self.on([array]):
            buf = array.tensor.clone(memory_format=torch.contiguous_format)
            if buf.numel():
                opts = self._dist.BroadcastOptions()
                opts.rootRank, opts.rootTensor = root, 0
                self._run("broadcast", lambda: self._pg.broadcast([buf], opts))
        return buf

    def allgather(self, array, dims):
        """Every rank's ``array`` stacked along the first dimension (``dims``: each rank's
        first dimension; the blocks travel padded to the largest)."""
        torch = self._torch
        x = array.tensor
        shape = tuple(x.shape) if x.dim() else (1,)
        row = math.prod(shape[1:])
        counts = [d * row for d in dims]
        width = max(counts)
        out_shape = (sum(dims),) + shape[1:]
        with self.on([array]) as device:
            if width == 0:
                return torch.empty(out_shape, dtype=x.dtype, device=device)
            mine = x.reshape(-1)
            if counts[self.rank] < width:
                mine = torch.cat([mine, mine.new_zeros(width - counts[self.rank])])
            gathered = torch.empty(width * self.size, dtype=x.dtype, device=device)
            self._run("allgather", lambda: self._pg._allgather_base(gathered, mine))
            if any(c != width for c in counts):
                gathered = torch.cat([gathered[p * width:p * width + c]
                                      for p, c in enumerate(counts)])
            out = gathered.view(out_shape)
        return out

    def zeros(self, shapes, dtype):
        """Device arrays of zeros (a rank that has joined contributes them)."""
        torch = self._torch
        tdtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
        return [_Zeros(torch.zeros(s, dtype=tdtype, device=self._device)) for s in shapes]

    def close(self):
        """Leave the group (local: every rank has passed its last collective)."""
        shut_down(getattr(self, "_pg", None), self._label)
        self._pg = self._store = None

    # -- helpers -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def on(self, arrays):
        """Run a collective's work on its tensors' device: after what their callers queued,
        and finished on the device before this returns."""
        device = self._device = arrays[0].tensor.device
        if not self._cuda:
            yield device
            return
        torch = self._torch
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device)
            for a in arrays:
                if a.ready is not None:
                    stream.wait_event(a.ready)
            yield device
            done = torch.cuda.Event()
            done.record(stream)
            self._wait(done)

    def _wait(self, event):
        """Until ``event`` has happened on the device, watching that every peer lives; at
        most ``timeout`` seconds (peers alive but the collective stuck)."""
        now = time.monotonic()
        spin_end, deadline = now + _SPIN_S, now + self._timeout
        while not event.query():
            now = time.monotonic()
            if now < spin_end:
                continue
            if now > deadline:
                self._abort()
                raise HoraInternalError(f"rank {self.rank}: a {self._label} collective did "
                                        f"not finish within {self._timeout:g} s while every "
                                        f"peer was alive")
            try:
                self._t.watch(timeout=_LOOK_S)
            except TransportBrokenError:
                self._abort()
                raise

    def _abort(self):
        """A peer is gone: release the kernels that wait for it, so this process can end."""
        abort = getattr(self._pg, "abort", None)
        if abort is not None:
            try:
                abort()
            except RuntimeError as e:
                log.debug("%s abort: %s", self._label, e)

    def _run(self, what, start):
        """Start a collective; for NCCL, the current stream then waits for it (the CPU does
        not), for gloo the call returns when it is done."""
        try:
            start().wait()
        except RuntimeError as e:
            raise_failure(self._t, f"{self._label} {what}", e)


class TorchOps:
    """What tensor fusion (:class:`hora.core.fusion.ArrayOps`) needs of torch tensors, on
    their own device."""

    def __init__(self, torch):
        self._torch = torch

    def numel(self, a):
        return a.numel()

    def flat_view(self, a):
        return a.view(-1) if a.is_contiguous() else None

    def flat_copy(self, a, dtype):
        return a.reshape(-1).to(dtype, copy=True, memory_format=self._torch.contiguous_format)

    def empty(self, n, dtype, like):
        return self._torch.empty(n, dtype=dtype, device=like.device)

    def pool_key(self, dtype, like):
        return (like.device, dtype)

    def concat_into(self, arrays, out):
        self._torch.cat([x.reshape(-1) for x in arrays], out=out)

    def view(self, part, like):
        return part.view(like.shape)

    def copy_back(self, dst, part, fused):
        if part.data_ptr() != dst.data_ptr():
            dst.copy_(part)

    def scale(self, buf, factor, divisor):
        """buf *= factor / divisor, in place, rounded as the host path (hora.core.fusion.scale):
        one double-precision factor; torch multiplies float16 and bfloat16 in float32 and float32
        by the factor rounded to float32; integers in float64, truncated toward zero."""
        scale = float(factor) / divisor
        if scale == 1:
            return
        if buf.is_floating_point():
            buf.mul_(scale)
        else:
            buf.copy_(self._torch.trunc(buf.double() * scale))

    def dtype_of(self, a):
        return a.dtype
