"""hora as a ``torch.distributed`` backend: ``dist.init_process_group("hora")``.

Importing :mod:`hora.torch` registers the backend ``"hora"``; then code written for
``torch.distributed`` (``DistributedDataParallel``, its communication hooks,
``ZeroRedundancyOptimizer``, FSDP2, ``torch.distributed.checkpoint``, the object collectives)
runs its collectives on hora's engine and planes::

    import torch.distributed as dist
    import hora.torch                       # registers "hora"
    dist.init_process_group("hora")         # under torchrun, or hora run
    model = torch.nn.parallel.DistributedDataParallel(model)

The group is a Python :class:`torch.distributed.ProcessGroup` (:class:`HoraProcessGroup`)
whose collectives are hora's: each returns a ``Work`` whose ``wait()`` waits in the caller
(driving hora's engine, as ``hora.torch.synchronize`` does) and whose ``get_future()`` is
completed by a thread of this module as soon as the collective finishes, so that DDP's
callbacks run without anyone waiting.  hora's promises hold: a rank that dies is named on
every survivor, a mismatched collective fails on every rank (the future's exception, and
``wait()``'s).

torch's collectives have no names; hora names a group's k-th call ``torch.<k mod SLOTS>``,
except a blocking ``all_reduce``, ``broadcast`` or ``barrier``, named :data:`SYNC` (every
rank makes the same calls in the same order, so every rank names them alike): a call whose
kind, shape, dtype or op differs between ranks meets its peers' under one name and fails on
every rank, saying what differs, and in steady-state training (the same calls each step)
each name's requests recur and hora's response cache answers them.  Those three blocking
calls (``dist.all_reduce(t)``) are hora's blocking calls, which settle small ones on the
host's shared-memory board; the other blocking calls wait on their asynchronous form.

A group of some ranks (``dist.new_group(ranks)``, ``new_subgroups``, a ``DeviceMesh``'s
dimensions) runs on a hora process set of its own, which its members register when torch
makes the group (the other ranks have nothing to do).  What hora does not do
(point-to-point messages, bitwise reductions) raises :class:`HoraError` naming the
operation.

Layer: torch (a binding on hora's core, as :mod:`hora.torch.mpi_ops`).
"""
from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections.abc import MutableMapping
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.futures import Future
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import config
from ..core import basics, stats
from ..core import ops as core
from ..core.process_sets import ProcessSet, add_process_set_by_members, global_process_set
from ..errors import CollectiveTimeoutError, HoraError
from . import mpi_ops as ops
from .optimizer import WRAPPED, DistributedOptimizer

__all__ = ["HoraProcessGroup", "BACKEND", "SLOTS", "SYNC", "register"]

BACKEND = "hora"
SLOTS = 16              # names the calls cycle through: a name's last call must be done
SYNC = "torch.sync"     # a blocking all_reduce, broadcast or barrier (one at a time)

_OPS = {"SUM": ops.Sum, "AVG": ops.Average, "PRODUCT": ops.Product, "MIN": ops.Min,
        "MAX": ops.Max}


def _op(reduce_op, what: str) -> int:
    kind = getattr(reduce_op, "op", reduce_op)      # a ReduceOp, or its RedOpType
    got = _BY_KIND.get(kind)
    if got is None:
        name = getattr(kind, "name", str(kind))
        if name not in _OPS:
            raise HoraError(f"{what}: the hora backend has no reduce op {name} (it has "
                            f"{', '.join(_OPS)})")
        got = _BY_KIND[kind] = _OPS[name]
    return got


_BY_KIND: dict[Any, int] = {}       # RedOpType -> hora's op, as met (a lookup a call)


# -- completing futures -----------------------------------------------------------------------
class _Completer:
    """A thread that waits for each collective whose future was asked for, in the order
    they were started, and completes the future (its result, or the collective's error)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def add(self, work: "_Work") -> None:
        self._queue.put(work)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hora-torch-futures",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            self._queue.get()._settle()


_completer = _Completer()


class _Work(dist._Work):
    """One collective: ``finish(result)`` turns hora's result into the tensors torch
    expects (writing outputs in place) and returns the future's value."""

    def __init__(self, handle: Any, finish: Callable[[Any], Any]) -> None:
        super().__init__()
        self._handle, self._finish = handle, finish
        self._lock = threading.Lock()
        self._future: Future | None = None
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None

    def _settle(self, timeout_s: float | None = None) -> None:
        """Wait for the collective (once; at most ``timeout_s``, else while the job lives),
        then complete the future if one was asked for.

        Raises:
            CollectiveTimeoutError: ``timeout_s`` passed first (the collective goes on).
        """
        with self._lock:
            if not self._done:
                try:
                    self._value = self._finish(self._handle.wait(timeout_s))
                except BaseException as e:  # noqa: BLE001 - it is the future's to raise
                    if (timeout_s is not None and isinstance(e, CollectiveTimeoutError)
                            and not self._handle.poll()):
                        raise               # (this wait gave up; the collective goes on)
                    self._error = e
                self._done = True
                self._handle = self._finish = None
            future = self._future
        if future is not None and not future.done():
            if self._error is not None:
                future.set_exception(self._error)
            else:
                future.set_result(self._value)

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = timeout.total_seconds() if timeout else 0.0      # (torch's 0: no limit)
        self._settle(seconds if seconds > 0 else None)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        handle = self._handle
        return self._done or (handle is not None and handle.poll())

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> Any:
        self.wait()
        return self._value

    def get_future(self) -> Future:
        with self._lock:
            new, done = self._future is None, self._done
            if new:
                self._future = Future()
        if new and done:
            self._settle()              # completes it here
        elif new:
            _completer.add(self)        # the thread completes it
        return self._future


def _blocking(opts: Any) -> bool:
    """Whether torch makes this call blocking (``dist.all_reduce(t)``: ``opts.asyncOp``
    False): then hora's blocking call runs it, which settles small ones on the host's
    shared-memory board instead of the engine (DDP's calls are asynchronous)."""
    return opts is not None and not getattr(opts, "asyncOp", True)


def _done(value: Any) -> _Work:
    """A Work that has nothing to wait for."""
    return _Work(_Ready(), lambda _: value)


class _Ready:
    def wait(self, timeout: float | None = None) -> None:
        return None

    def poll(self) -> bool:
        return True


# -- the process group ------------------------------------------------------------------------
class HoraProcessGroup(dist.ProcessGroup):
    """torch.distributed's collectives on hora: the whole job (``dist.group.WORLD``), or a
    group of some ranks (``dist.new_group(ranks)``) on a hora process set of its own."""

    def __init__(self, rank: int, size: int,
                 process_set: ProcessSet = global_process_set) -> None:
        super().__init__(rank, size)
        self._set = process_set                 # its ranks, in group rank order
        self._ranks = process_set.ranks
        self._slot = 0
        self._last: dict[str, _Work] = {}

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    # torch's ProcessGroup keeps its name in its per-device backends, which this group has
    # none of: without these, ``group_name`` raises "ProcessGroup name not set" and
    # DeviceMesh (FSDP2, DTensor, torch.distributed.checkpoint) cannot use the group
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _name(self) -> str:
        """The next call's name: ``torch.<k>``, ``k`` cycling through :data:`SLOTS`; the
        name's previous call is waited for first (it is SLOTS calls old: done, all but
        always)."""
        slot = self._slot
        self._slot = (slot + 1) % SLOTS
        name = f"torch.{slot}"
        last = self._last.pop(name, None)
        if last is not None:
            last._settle()
        return name

    def _start(self, name: str, handle: Any, finish: Callable[[Any], Any]) -> _Work:
        work = _Work(handle, finish)
        self._last[name] = work
        return work

    # allreduce, broadcast -------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "allreduce")
        if _blocking(opts):     # (a small one settles on the host's board, as hora's own)
            for t in tensors:
                ops.allreduce_(t, name=SYNC, op=op, process_set=self._set)
            return _done(tensors)
        works = []
        for t in tensors:
            name = self._name()
            h = ops.allreduce_async_(t, name=name, op=op, process_set=self._set)
            works.append(self._start(name, h, lambda _: None))
        return self._joined(works, tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        root = self._ranks[opts.rootRank]
        if _blocking(opts):
            for t in tensors:
                ops.broadcast_(t, root, name=SYNC, process_set=self._set)
            return _done(tensors)
        works = []
        for t in tensors:
            name = self._name()
            h = ops.broadcast_async_(t, root, name=name, process_set=self._set)
            works.append(self._start(name, h, lambda _: None))
        return self._joined(works, tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        op, root = _op(opts.reduceOp, "reduce"), opts.rootRank
        works = []
        for t in tensors:
            name = self._name()
            h = ops.allreduce_async(t, name=name, op=op, process_set=self._set)
            works.append(self._start(name, h, lambda r, t=t: t.copy_(r)
                                     if self.rank() == root else None))
        return self._joined(works, tensors)

    # gathers ---------------------------------------------------------------------------------
    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> _Work:
        works = []
        for outs, t in zip(outputs, inputs):
            name = self._name()
            h = ops.allgather_async(t.reshape(1, *t.shape), name=name, process_set=self._set)
            works.append(self._start(name, h, lambda r, outs=outs: [
                o.copy_(r[i].view_as(o)) for i, o in enumerate(outs)]))
        return self._joined(works, outputs)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> _Work:
        name = self._name()
        h = ops.allgather_async(input.reshape(1, -1), name=name, process_set=self._set)
        return self._start(name, h, lambda r: [output.copy_(r.view_as(output))])

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor], opts: Any = None) -> _Work:
        return self._joined([self.all_gather_single(o, i) for o, i in zip(outputs, inputs)],
                            outputs)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts: Any) -> _Work:
        """An allgather whose outputs only the root keeps."""
        mine = outputs if self.rank() == opts.rootRank else [[] for _ in inputs]
        return self.allgather(mine, inputs)

    # scatters --------------------------------------------------------------------------------
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> _Work:
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM,
                 "reduce_scatter_tensor")
        name = self._name()
        h = ops.reducescatter_async(input.reshape(self.size(), -1), name=name, op=op,
                                    process_set=self._set)
        return self._start(name, h, lambda r: [output.copy_(r.view_as(output))])

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                       opts: Any = None) -> _Work:
        works = [self.reduce_scatter_single(o, torch.stack([x.reshape(-1) for x in ins]), opts)
                 for o, ins in zip(outputs, inputs)]
        return self._joined(works, outputs)

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> _Work:
        return self._joined([self.reduce_scatter_single(o, i, opts)
                             for o, i in zip(outputs, inputs)], outputs)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                opts: Any) -> _Work:
        root, size, works = opts.rootRank, self.size(), []
        for i, out in enumerate(outputs):
            if self.rank() == root:
                send = torch.stack([x.reshape(-1) for x in inputs[i]])
                splits = [1] * size
            else:
                send, splits = out.new_empty((0, out.numel())), [0] * size
            name = self._name()
            h = ops.alltoall_async(send, splits, name=name, process_set=self._set)
            works.append(self._start(name, h, lambda r, out=out: out.copy_(
                r[0].view_as(out))))
        return self._joined(works, outputs)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> _Work:
        splits = list(input_split_sizes) or None
        name = self._name()
        h = ops.alltoall_async(input, splits, name=name, process_set=self._set)
        return self._start(name, h, lambda r: [output.copy_(r[0].view_as(output))])

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                 opts: Any = None) -> _Work:
        flat = torch.cat([x.reshape(-1) for x in inputs])
        splits = [x.numel() for x in inputs]
        name = self._name()
        h = ops.alltoall_async(flat, splits, name=name, process_set=self._set)

        def finish(r: Any) -> list[torch.Tensor]:
            got = r[0]
            at = 0
            for o in outputs:
                o.copy_(got[at:at + o.numel()].view_as(o))
                at += o.numel()
            return outputs
        return self._start(name, h, finish)

    # the rest --------------------------------------------------------------------------------
    def barrier(self, opts: Any = None) -> _Work:
        if _blocking(opts):
            core.barrier(SYNC, self._set)
            return _done(None)
        name = self._name()
        return self._start(name, core.barrier_async(name, self._set), lambda _: None)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> _Work:
        raise HoraError(f"send (to rank {dst}): the hora backend has no point-to-point "
                        f"messages; use a collective (broadcast, alltoall) or a gloo group")

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> _Work:
        raise HoraError(f"recv (from rank {src}): the hora backend has no point-to-point "
                        f"messages; use a collective (broadcast, alltoall) or a gloo group")

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> _Work:
        raise HoraError("recv (from any rank): the hora backend has no point-to-point "
                        "messages")

    # the names of the same calls in torch before 2.10
    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
    alltoall_base = all_to_all_single

    @staticmethod
    def _joined(works: list[_Work], value: Any) -> _Work:
        """One Work for several (torch's list-of-tensors calls): done when all are."""
        if len(works) == 1:
            only = works[0]
            own = only._finish
            only._finish = lambda r: (own(r), value)[1]
            return only

        def all_done(_: Any) -> Any:
            for w in works:
                w.wait()
            return value
        return _Work(_Ready(), all_done)


# -- registration -----------------------------------------------------------------------------
def _create(opts: Any, backend_options: Any = None) -> HoraProcessGroup:
    """torch's call when a group of backend "hora" is made (``init_process_group``,
    ``new_group``)."""
    if not basics.is_initialized():
        _agree_rendezvous_port(opts)
        basics.init()
    size, rank = basics.size(), basics.rank()
    if not dist.is_initialized():           # init_process_group: the whole job
        if opts.group_size != size or opts.group_rank != rank:
            raise HoraError(f"init_process_group('hora') was given rank {opts.group_rank} "
                            f"of {opts.group_size}, but hora.init() placed this process as "
                            f"rank {rank} of {size}: launch with one placement (torchrun's "
                            f"RANK and WORLD_SIZE, or hora run's)")
        _count_steps()
        return HoraProcessGroup(rank, size)
    # new_group(ranks): torch makes the group on its members only, so they alone register
    # its process set (in the order torch makes groups, the same on every member)
    ranks = sorted(opts.global_ranks_in_group) or list(range(size))
    process_set = add_process_set_by_members(ranks)
    return HoraProcessGroup(process_set.rank(), len(ranks), process_set)


def _count_steps() -> None:
    """Count every optimizer step of this process as a training step of hora's (``hora run
    --monitor``'s steps/s, ``hora.metrics()["steps"]``), as DistributedOptimizer counts its
    own: DDP, FSDP and Accelerate step plain torch optimizers.  Once a process."""
    global _step_hook
    if _step_hook is None:
        def counted(opt: Any, args: Any, kwargs: Any) -> None:
            if not isinstance(opt, DistributedOptimizer) and opt not in WRAPPED:
                stats.step()
        _step_hook = register_optimizer_step_post_hook(counted)


_step_hook: Any = None


def _agree_rendezvous_port(opts: Any, env: MutableMapping[str, str] = os.environ) -> None:
    """Under torchrun (RANK and WORLD_SIZE, no hora placement, no HORA_RENDEZVOUS_PORT), the
    port rank 0 serves hora's rendezvous on, agreed through torch's store: a free port of
    rank 0's, not MASTER_PORT + 1 (hora.init()'s guess), which with torchrun's c10d
    rendezvous (MASTER_PORT drawn from the ephemeral range) another connection may hold.

    torchrun's store outlives a restart of the workers, so a port read may be the last
    attempt's: a rank takes it once something listens there (rank 0 serves it before it
    waits for the others), else reads again."""
    if ("HORA_RANK" in env or "HORA_RENDEZVOUS_PORT" in env or "RANK" not in env
            or "WORLD_SIZE" not in env or int(env["WORLD_SIZE"]) < 2 or opts.store is None):
        return
    key = "hora/rendezvous_port"
    if opts.group_rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        opts.store.set(key, str(port))
    else:
        addr = env.get("MASTER_ADDR", "127.0.0.1")
        limit = config.env_value("START_TIMEOUT", env)
        deadline = time.monotonic() + limit
        try:
            opts.store.wait([key], timedelta(seconds=limit))
        except Exception as e:          # noqa: BLE001 - torch's store raises its own kinds
            raise HoraError(f"rank {opts.group_rank}: rank 0 told no rendezvous port through "
                            f"torch's store within {limit:g} s (HORA_START_TIMEOUT): {e}") from e
        while True:
            port = int(opts.store.get(key))
            try:
                socket.create_connection((addr, port), timeout=1.0).close()
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise HoraError(f"rank {opts.group_rank}: rank 0 serves no rendezvous "
                                    f"at {addr}:{port} (told by torch's store): {e}") from e
                time.sleep(0.05)
    env["HORA_RENDEZVOUS_PORT"] = str(port)


def register(env: MutableMapping[str, str] = os.environ) -> None:
    """Register the backend ``"hora"`` with torch.distributed (done on import of
    :mod:`hora.torch`; again is harmless).

    Under hora's own placement (``hora run``), torch's ``env://`` finds what it reads under
    torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are set from
    ``HORA_*`` where unset (``hora run`` sets ``MASTER_ADDR`` and ``MASTER_PORT``)."""
    if "HORA_RANK" in env and "HORA_SIZE" in env:
        for torch_name, hora_name in _PLACEMENT:
            if hora_name in env:
                env.setdefault(torch_name, env[hora_name])
    if BACKEND.upper() not in getattr(dist.Backend, "_plugins", {}):
        dist.Backend.register_backend(BACKEND, _create, extended_api=True,
                                      devices=["cpu", "cuda"])


_PLACEMENT = (("RANK", "HORA_RANK"), ("WORLD_SIZE", "HORA_SIZE"),
              ("LOCAL_RANK", "HORA_LOCAL_RANK"), ("LOCAL_WORLD_SIZE", "HORA_LOCAL_SIZE"))
