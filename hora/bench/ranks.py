"""What every rank of a ``hora bench`` job runs, whatever the system under test.

Each system is a small communicator class with the same six methods (``prepare``,
``allreduce``, ``to_numpy``, ``barrier``, ``max``, ``close``); :func:`measure` drives any of
them through the same verify / warm up / time loop, so every system does the same work.

hora's ranks are started by ``hora.runner.run`` (:func:`hora_job`), gloo's by
``multiprocessing`` (:func:`gloo_worker`), MPI's, Horovod's and hora-mpi's by their own
launchers, which run ``python -m hora.bench.ranks SYSTEM PLAN OUT``: every rank writes
its numbers to ``OUT.<rank>.json``.

Layer: bench (it imports the bindings it measures, lazily, in the ranks only).
"""
import json
import mmap
import os
import sys
import time
import traceback

import numpy as np

__all__ = ["ResultMismatch", "measure", "hora_job", "gloo_worker", "rank_file",
           "verify_input", "expected_sum", "machine_probe_us", "LineProbe", "LINE_FILE_BYTES"]

KiB, MiB = 1 << 10, 1 << 20
MIN_ITERS, MAX_ITERS = 3, 2000      # per round, unless the size budget says fewer


class ResultMismatch(RuntimeError):
    """An allreduce returned the wrong sum: the system (or its setup) is broken."""


def verify_input(n, rank):
    """Rank ``rank``'s known input: (rank + 1) + (i % 13); small integers, exact in float32."""
    return (np.arange(n, dtype=np.int64) % 13 + (rank + 1)).astype(np.float32)


def expected_sum(n, size):
    """The sum over ``size`` ranks of :func:`verify_input`, computed in closed form."""
    return (np.arange(n, dtype=np.int64) % 13 * size + size * (size + 1) // 2).astype(np.float32)


WARM_S = 0.05       # every size warms up at least this long (on the slowest rank)
SETTLE_S = 0.5      # and a job's first size this long: its ranks have just started


PROBE_LOOP, PROBE_TRIES = 300, 5    # the speed probe: additions of a loop, and its tries


def machine_probe_us():
    """The least time, in microseconds, that a fixed loop of Python (PROBE_LOOP additions)
    takes on this process over PROBE_TRIES tries: how fast this CPU runs Python now.

    Every system's ranks take it after each timed round, so that a ratio of two systems can
    say whether the machine ran at the same speed for both.  A machine shared with other
    tenants does not: on a 2-CPU guest this loop took 7.5-8.7 us in some processes and
    11-13.5 us in others, pinned to the same CPU, for seconds at a time, and hora's 64 B
    round at N = 4 took 22-25 us or 41-48 us along with it (docs/performance-notes.md)."""
    best = float("inf")
    for _ in range(PROBE_TRIES):
        t0 = time.perf_counter()
        total = 0
        for i in range(PROBE_LOOP):
            total += i
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


LINE_TRIES, LINE_EXCHANGES = 5, 200     # the line probe: tries, and round trips in each
LINE_WAIT_S = 0.5           # how long a probing rank waits for its partner, at most
LINE_FILE_BYTES = 4096      # the probe's shared file: a ping word and a pong word
_PING, _PONG = 0, 8         # (64 bytes apart: each word has a cache line of its own)
_SPIN = range(256)          # looks at the word between two looks at the clock


class LineProbe:
    """How far apart, in time, this machine's CPUs are now: the least time a round trip of
    one word takes between ranks 0 and 1, pinned to two different CPUs for the probe, in
    nanoseconds (the best of LINE_TRIES tries of LINE_EXCHANGES round trips, through the
    shared file ``path``, zeroed before the job).

    A guest's virtual CPUs move between the host's cores: within seconds the same Python
    round trip took 250-450 ns and then 700-800 ns, and hora's 1 MiB allreduce at N = 2
    took 140-190 us and then 450-550 us along with it, every copy of a shared buffer slower,
    while the speed probe (:func:`machine_probe_us`, one CPU) did not move
    (docs/performance-notes.md).  Every system's ranks 0 and 1 take it after each
    round, so that a ratio of two systems can say whether the data crossed the same
    distance for both.

    :meth:`probe` returns None on the other ranks, with fewer than two CPUs to pin to, or
    without the file; and from the first time the partner did not answer within
    LINE_WAIT_S on (the probe then stays off for the job, and never waits again)."""

    def __init__(self, rank, size, path):
        self.rank = rank
        self._w = None
        self._seq = 0
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if path is None or rank > 1 or size < 2 or len(cpus) < 2:
            return
        self._cpus, self._mine = set(cpus), cpus[rank]
        fd = os.open(path, os.O_RDWR)
        try:
            self._w = memoryview(mmap.mmap(fd, LINE_FILE_BYTES)).cast("Q")   # (keeps the map)
        finally:
            os.close(fd)

    def probe(self):
        """This round's figure (ns a round trip), or None (see the class)."""
        if self._w is None:
            return None
        os.sched_setaffinity(0, {self._mine})
        try:
            best = float("inf")
            for _ in range(LINE_TRIES):
                t0 = time.perf_counter()
                if not self._exchanges():
                    self._w = None          # (the partner is gone or late: off for good)
                    return None
                best = min(best, time.perf_counter() - t0)
        finally:
            os.sched_setaffinity(0, self._cpus)
        return best / LINE_EXCHANGES * 1e9

    def _exchanges(self):
        """LINE_EXCHANGES round trips: rank 0 writes the ping word and awaits its echo in the
        pong word; rank 1 echoes each ping.  False when the partner did not answer in time."""
        w, deadline = self._w, time.perf_counter() + LINE_WAIT_S
        ping = self.rank == 0
        at = _PONG if ping else _PING
        first = self._seq + 1
        self._seq += LINE_EXCHANGES
        for seq in range(first, self._seq + 1):
            if ping:
                w[_PING] = seq
            while w[at] != seq:
                for _ in _SPIN:         # (a look at the clock every 256 looks at the word)
                    if w[at] == seq:
                        break
                else:
                    if time.perf_counter() > deadline:
                        return False
            if not ping:
                w[_PONG] = seq
        return True


def _warmup_count(nbytes):
    return 10 if nbytes <= 64 * KiB else 3 if nbytes <= 4 * MiB else 1


def _warm_up(comm, buf, nbytes, min_s):
    """Warm-up iterations in batches (each twice the last) until ``min_s`` seconds have
    passed on the slowest rank: every rank stops after the same batch.  Returns the mean
    time of an iteration in the last batch, on the slowest rank (the same on every rank).

    Just after the ranks start, the kernel has yet to settle where it runs them: with more
    ranks than CPUs, hora's 4 B allreduce took twice as long for the first 0.1-0.3 s.  The
    warm-up also lasts while a system still tunes itself on these calls
    (``comm.tuning(nbytes)``: hora's hierarchical plane measures its piece size on its first
    allreduces of 8 MiB or more)."""
    batch = _warmup_count(nbytes)
    tuning = getattr(comm, "tuning", None)      # (the same system on every rank)
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        for _ in range(batch):
            comm.allreduce(buf, nbytes)
        per_iter = comm.max((time.perf_counter() - t0) / batch)
        if comm.max(time.perf_counter() - start) >= min_s and not (
                tuning and comm.max(float(tuning(nbytes)))):
            return per_iter
        batch *= 2


def _check(comm, nbytes):
    n = max(1, nbytes // 4)
    got = comm.to_numpy(comm.allreduce(comm.prepare(verify_input(n, comm.rank)), nbytes))
    want = expected_sum(n, comm.size)
    if got.shape == want.shape and np.array_equal(got, want):
        return
    bad = int(np.flatnonzero(got.reshape(-1) != want)[0]) if got.shape == want.shape else -1
    raise ResultMismatch(
        f"rank {comm.rank}: allreduce of {nbytes} B returned a wrong sum (first bad index "
        f"{bad}: got {got.reshape(-1)[bad] if bad >= 0 else got.shape}, want "
        f"{want[bad] if bad >= 0 else want.shape})")


def _measure_size(comm, nbytes, plan, line, warm_s=WARM_S):
    """Verify, warm up (at least ``warm_s`` seconds) and time one size; returns
    ``{"bytes", "iters", "round_s", "probe_us", "line_ns"}`` (right after each round, this
    rank's :func:`machine_probe_us` and ``line``'s :meth:`LineProbe.probe`, None on ranks
    above 1)."""
    _check(comm, nbytes)
    buf = comm.prepare(np.zeros(max(1, nbytes // 4), dtype=np.float32))  # zeros stay finite
    comm.barrier()
    per_iter = _warm_up(comm, buf, nbytes, warm_s)
    iters = min(MAX_ITERS, max(MIN_ITERS, int(plan["round_s"] // per_iter)))
    rounds, budget = plan["rounds"], plan["size_budget_s"]
    if iters * per_iter * rounds > budget:      # large sizes: give up iterations, then rounds
        iters = max(1, int(budget // (rounds * per_iter)))
        rounds = max(1, min(rounds, int(budget // (iters * per_iter))))
    times, probes, lines = [], [], []
    for _ in range(rounds):
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            comm.allreduce(buf, nbytes)
        times.append((time.perf_counter() - t0) / iters)
        probes.append(machine_probe_us())
        lines.append(line.probe())
    return {"bytes": nbytes, "iters": iters, "round_s": times, "probe_us": probes,
            "line_ns": lines}


def measure(comm, plan):
    """Every size of ``plan`` on ``comm``: a list of :func:`_measure_size` records
    (``plan["line_file"]``: :class:`LineProbe`'s file, when the job has one)."""
    line = LineProbe(comm.rank, comm.size, plan.get("line_file"))
    return [_measure_size(comm, nbytes, plan, line, SETTLE_S if i == 0 else WARM_S)
            for i, nbytes in enumerate(plan["sizes"])]


def _hora_tunes(nbytes):
    """Whether hora's data plane would still measure itself on an allreduce of ``nbytes``."""
    from hora.core import state
    measures = getattr(state.engine()._plane, "measures", None)
    return bool(measures and measures(nbytes))


# -- one communicator per system ----------------------------------------------------------------
class _Names(dict):
    """The collective's name for each size, made once: a training step passes the same
    string again and again, not a new one each call (formatting one and hashing it anew
    cost a tenth of a microsecond a call, a few percent of a small round)."""

    def __missing__(self, nbytes):
        name = self[nbytes] = f"bench.{nbytes}"
        return name


class _HoraComm:
    """hora's NumPy API; one fixed name per size, as a training step reuses its names."""

    def __init__(self):
        import hora
        self._hora = hora
        hora.init()
        self.rank, self.size = hora.rank(), hora.size()
        self._names = _Names()

    def prepare(self, array):
        return array

    def allreduce(self, buf, nbytes):       # in place, as gloo's all_reduce
        return self._hora.allreduce_(buf, op=self._hora.Sum, name=self._names[nbytes])

    def to_numpy(self, result):
        return result

    def barrier(self):
        self._hora.barrier()

    def max(self, x):
        return float(self._hora.allreduce(np.array([x]), op=self._hora.Max, name="bench.max")[0])

    def tuning(self, nbytes):
        return _hora_tunes(nbytes)

    def close(self):
        self._hora.shutdown()


class _TorchApiComm:
    """A CPU tensor through ``allreduce_(tensor, name=, op=Sum)`` (in place) of a
    Horovod-style torch binding (``hora.torch`` or ``horovod.torch``), one torch thread per
    rank."""

    def __init__(self, module):
        import importlib
        import torch
        torch.set_num_threads(1)
        self._torch, self._hvd = torch, importlib.import_module(module)
        self._hvd.init()
        self.rank, self.size = self._hvd.rank(), self._hvd.size()
        self._names = _Names()

    def prepare(self, array):
        return self._torch.from_numpy(array.copy())

    def allreduce(self, buf, nbytes):       # in place, as gloo's all_reduce
        return self._hvd.allreduce_(buf, name=self._names[nbytes], op=self._hvd.Sum)

    def to_numpy(self, result):
        return result.numpy()

    def barrier(self):          # an allreduce: Horovod's barrier() is recent
        self._hvd.allreduce(self._torch.zeros(1), name="bench.barrier", op=self._hvd.Sum)

    def max(self, x):
        t = self._torch.tensor([x], dtype=self._torch.float64)
        return float(self._hvd.allreduce(t, name="bench.max", op=self._hvd.Max)[0])

    def tuning(self, nbytes):
        return self._hvd.__name__.startswith("hora") and _hora_tunes(nbytes)

    def close(self):
        self._hvd.shutdown()


class _GlooComm:
    """torch.distributed with the gloo backend; ``all_reduce`` works in place on a tensor."""

    def __init__(self, rank, size, port, timeout_s):
        import datetime
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)    # as hora: one reducing thread per rank
        self._torch, self._dist = torch, dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size, timeout=datetime.timedelta(seconds=timeout_s))
        self.rank, self.size = rank, size

    def prepare(self, array):
        return self._torch.from_numpy(array.copy())

    def allreduce(self, buf, nbytes):
        self._dist.all_reduce(buf, op=self._dist.ReduceOp.SUM)
        return buf

    def to_numpy(self, result):
        return result.numpy()

    def barrier(self):
        self._dist.barrier()

    def max(self, x):
        t = self._torch.tensor([x], dtype=self._torch.float64)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX)
        return float(t[0])

    def close(self):
        self._dist.destroy_process_group()


class _MpiComm:
    """mpi4py's buffer API, out of place into a preallocated array."""

    def __init__(self):
        from mpi4py import MPI
        self._mpi, self._comm = MPI, MPI.COMM_WORLD
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()

    def prepare(self, array):
        return array, np.empty_like(array)

    def allreduce(self, bufs, nbytes):
        self._comm.Allreduce(bufs[0], bufs[1], op=self._mpi.SUM)
        return bufs[1]

    def to_numpy(self, result):
        return result

    def barrier(self):
        self._comm.Barrier()

    def max(self, x):
        return self._comm.allreduce(x, op=self._mpi.MAX)

    def close(self):
        pass


# -- entry points -------------------------------------------------------------------------------
def hora_job(plan, api="numpy"):
    """Runs on every rank of a ``hora.runner.run`` job: the NumPy API or ``hora.torch``."""
    comm = _HoraComm() if api == "numpy" else _TorchApiComm("hora.torch")
    try:
        return measure(comm, plan)
    finally:
        comm.close()


def gloo_worker(rank, size, port, plan, results):
    """Target of one spawned gloo rank; puts ``(rank, "ok"|"error", payload)`` on ``results``."""
    try:
        comm = _GlooComm(rank, size, port, plan["job_timeout_s"])
        try:
            results.put((rank, "ok", measure(comm, plan)))
        finally:
            comm.close()
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, "error", traceback.format_exc()))


def rank_file(out_prefix, rank):
    """Where rank ``rank`` of a launcher-started job writes its numbers."""
    return f"{out_prefix}.{rank}.json"


def main(argv=None):
    """``python -m hora.bench.ranks {mpi,horovod,hora-*} PLAN OUT`` on every rank."""
    system, plan_path, out_prefix = argv if argv is not None else sys.argv[1:]
    with open(plan_path) as f:
        plan = json.load(f)
    comm = (_MpiComm() if system == "mpi" else _HoraComm() if system.startswith("hora")
            else _TorchApiComm("horovod.torch"))
    try:
        result = measure(comm, plan)
    finally:
        comm.close()
    with open(rank_file(out_prefix, comm.rank), "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
