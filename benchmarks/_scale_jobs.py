"""What every rank of a ``scale.py`` job runs, for hora, Open MPI (mpi4py) and torch gloo.

Run by each system's launcher as ``python _scale_jobs.py SYSTEM PLAN OUT``: the rank joins
the job, completes one allreduce (rank 0 then prints ``startup.MARK`` and the wall-clock time,
which the harness reads as ``startup.py`` does), counts the sockets it holds, times the 4 B
and 1 MiB allreduces and a training-like step (hora also counts the control messages of the
same step as one grouped allreduce), and writes ``OUT/rank<r>.json``.  Also
:func:`kill_job`, hora's killed-rank job, which ``scale.py`` starts through
``tests.helpers.RawJob``.  Imported by ``scale.py`` (the benchmarks folder is sys.path[0]).
"""
import json
import os
import sys
import time

import numpy as np

from startup import MARK

GRADS = 100                 # the step's gradients, as a model's named parameters
GRAD_FLOATS = [256 << (i % 7) for i in range(GRADS)]    # 1 KiB .. 64 KiB each, cycling
GROUP_NAME = "scale.grads"  # the grouped step's one collective
CACHED_AFTER = 2            # steps before hora's response cache holds a step's requests
GROUPED_STEPS = 20          # the grouped steps counted (after as many to warm up)


class _Hora:
    """hora's NumPy API: fixed names, so that the response cache answers repeated calls."""

    def __init__(self):
        import hora
        self.h = hora
        hora.init()
        self.rank, self.size = hora.rank(), hora.size()

    def prepare(self, array):
        return array

    def allreduce(self, buf):
        self.h.allreduce_(buf, op=self.h.Sum, name=f"scale.{buf.nbytes}")

    def step(self, grads):
        handles = [self.h.allreduce_async_(g, op=self.h.Sum, name=f"grad.{i}")
                   for i, g in enumerate(grads)]
        for handle in handles:
            self.h.synchronize(handle)

    def grouped_step(self, grads):
        self.h.synchronize(self.h.grouped_allreduce_async_(grads, op=self.h.Sum,
                                                           name=GROUP_NAME))

    def barrier(self):
        self.h.barrier(name="scale.barrier")    # named: cached, as a training loop's would be

    def bcast(self, x):
        return self.h.broadcast_object(x, root_rank=0, name="scale.count")

    def control(self):
        """Control messages and bytes so far (``hora.metrics()["control"]``)."""
        return self.h.metrics()["control"]

    def close(self):
        self.h.shutdown()


class _Mpi:
    """mpi4py: ``Allreduce`` in place; the step is 100 ``Iallreduce`` and one ``Waitall``."""

    def __init__(self):
        from mpi4py import MPI
        self.mpi, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def prepare(self, array):
        return array

    def allreduce(self, buf):
        self.comm.Allreduce(self.mpi.IN_PLACE, buf, op=self.mpi.SUM)

    def step(self, grads):
        reqs = [self.comm.Iallreduce(self.mpi.IN_PLACE, g, op=self.mpi.SUM) for g in grads]
        self.mpi.Request.Waitall(reqs)

    def barrier(self):
        self.comm.Barrier()

    def bcast(self, x):
        return self.comm.bcast(x, root=0)

    def close(self):
        pass


class _Gloo:
    """torch.distributed on gloo (ranks from ``torchrun``); the step is 100 asynchronous
    ``all_reduce`` calls, then a wait for each.  One torch thread, as each rank's share of
    two CPUs allows."""

    def __init__(self):
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        self.torch, self.dist = torch, dist
        dist.init_process_group("gloo")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def prepare(self, array):
        return self.torch.from_numpy(array)     # (once: a tensor over the same memory)

    def allreduce(self, buf):
        self.dist.all_reduce(buf)

    def step(self, grads):
        works = [self.dist.all_reduce(g, async_op=True) for g in grads]
        for work in works:
            work.wait()

    def barrier(self):
        self.dist.barrier()

    def bcast(self, x):
        box = [x]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self):
        self.dist.destroy_process_group()


COMMS = {"hora": _Hora, "mpi": _Mpi, "gloo": _Gloo}
TCP_ESTABLISHED = "01"      # the state column of /proc/net/tcp (include/net/tcp_states.h)


def _inet_table():
    """``{socket inode: (state, local "addr:port", remote "addr:port")}`` of this network
    namespace's TCP sockets (/proc/net/tcp and tcp6, addresses as the kernel writes them)."""
    table = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/self/net/{name}") as f:
                next(f)
                for line in f:
                    cols = line.split()
                    table[cols[9]] = (cols[3], cols[1], cols[2])
        except OSError:
            continue
    return table


def _unix_inodes():
    """The inodes of this network namespace's Unix sockets."""
    try:
        with open("/proc/self/net/unix") as f:
            next(f)
            return {line.split()[6] for line in f}
    except OSError:
        return set()


def sockets_held():
    """Every socket among this process's open files: how many, of which kinds, and each TCP
    connection's two ends (the harness finds which ones end at another rank of the job)."""
    inodes = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue                    # (closed since the listing: the listing's own fd)
        if target.startswith("socket:["):
            inodes.append(target[8:-1])
    tcp, unix = _inet_table(), _unix_inodes()
    established = [tcp[i][1:] for i in inodes if i in tcp and tcp[i][0] == TCP_ESTABLISHED]
    return {"total": len(inodes), "tcp": sum(i in tcp for i in inodes),
            "unix": sum(i in unix for i in inodes), "established": established}


def _warm_up(comm, call, warm_s):
    """Batches of ``call`` (each twice the last) until rank 0 has spent ``warm_s`` seconds,
    every rank stopping after the same batch (rank 0 decides); returns the mean seconds a
    call of the last batch took on rank 0, the same on every rank.  The first calls of a
    job run while the kernel still places its many ranks, many times slower than later."""
    batch, start = 1, time.perf_counter()
    while True:
        t0 = time.perf_counter()
        for _ in range(batch):
            call()
        now = time.perf_counter()
        per_call, done = comm.bcast(((now - t0) / batch, now - start >= warm_s))
        if done:
            return per_call
        batch *= 2


def _rounds(comm, call, round_s, most, plan, warm=None):
    """Per round (``plan["rounds"]``, each after a barrier), this rank's mean seconds and
    mean CPU seconds (``time.process_time``: every thread of the process) a call; a round
    is as many calls as take about ``round_s`` on rank 0 after the warm-up (after which
    ``warm()`` is called, when given), at most ``most``; the rounds together last about
    ``plan["budget_s"]`` at most."""
    per_call = _warm_up(comm, call, plan["warm_s"])
    if warm is not None:
        warm()
    calls = max(1, min(most, int(round_s / max(per_call, 1e-7))))
    # fewer rounds (two at least) where one call alone is slow: a step of gloo's at N = 64
    rounds = max(2, min(plan["rounds"], int(plan["budget_s"] / (calls * per_call))))
    wall, cpu = [], []
    for _ in range(rounds):
        comm.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(calls):
            call()
        wall.append((time.perf_counter() - t0) / calls)
        cpu.append((time.process_time() - c0) / calls)
    return {"calls": calls, "wall_s": wall, "cpu_s": cpu}


def _latency(comm, nbytes, plan):
    """Rounds of a blocking in-place allreduce of ``nbytes``."""
    buf = comm.prepare(np.zeros(nbytes // 4, np.float32))    # zeros stay finite, summed again
    return _rounds(comm, lambda: comm.allreduce(buf), plan["round_s"], 5000, plan)


def _steps(comm, plan):
    """Rounds of a training-like step: GRADS asynchronous allreduces, then a wait for each;
    for hora also the control messages a step (``control``: received, sent and their bytes,
    means over the steps after the warm-up, the barriers between rounds counted in).  The
    warm-up begins with ``CACHED_AFTER`` steps: hora caches a request the second time every
    rank sends it, so that a warm-up of one step left the second step's full requests among
    the counted ones."""
    grads = [comm.prepare(np.zeros(n, np.float32)) for n in GRAD_FLOATS]
    for _ in range(CACHED_AFTER):   # (a warm-up of one slow step would leave one uncached)
        comm.step(grads)
    steps = [0]
    control = getattr(comm, "control", None)
    before = {}

    def step():
        comm.step(grads)
        steps[0] += 1

    def warm():
        steps[0] = 0
        before.update(control() if control else {})
    out = _rounds(comm, step, plan["step_round_s"], 200, plan, warm)
    if control:
        after = control()
        out["control"] = {k: (after[k] - before[k]) / steps[0] for k in after}
    return out


def _grouped_control(comm):
    """hora's control messages and bytes a step of the same gradients as one grouped
    allreduce (``control``'s keys, means over ``GROUPED_STEPS`` steps after as many to warm
    up, no barrier among them): each rank sends one request a step, whatever the scheduler
    does, so that ``scale_model.py`` is compared with a run where timing has no say."""
    grads = [np.zeros(n, np.float32) for n in GRAD_FLOATS]
    for _ in range(GROUPED_STEPS):
        comm.grouped_step(grads)
    comm.barrier()
    before = comm.control()
    for _ in range(GROUPED_STEPS):
        comm.grouped_step(grads)
    after = comm.control()
    return {k: (after[k] - before[k]) / GROUPED_STEPS for k in after}


def rank_main(system, plan_path, out):
    with open(plan_path) as f:
        plan = json.load(f)
    comm = COMMS[system]()
    comm.allreduce(comm.prepare(np.ones(4, np.float32)))
    if comm.rank == 0:
        print(MARK, repr(time.time()), flush=True)
    record = {"rank": comm.rank, "size": comm.size, "sockets": sockets_held(),
              "latency": {str(n): _latency(comm, n, plan) for n in plan["sizes"]},
              "step": _steps(comm, plan)}
    if hasattr(comm, "grouped_step"):
        record["grouped"] = _grouped_control(comm)
    comm.barrier()
    with open(os.path.join(out, f"rank{comm.rank}.json"), "w") as f:
        json.dump(record, f)
    comm.close()


LOOP_CALLS = 100000         # the killed-rank job's loop: far more than it runs before the kill


def kill_job(victim, at_call, out):
    """One rank of hora's killed-rank job (started by ``tests.helpers.RawJob``): a loop of
    4 B allreduces, in which rank ``victim`` SIGKILLs itself before call ``at_call``
    (``tests.faults`` writes the moment to ``out/fault`` first).  A survivor returns the
    error it got, the rank it names and when it got it."""
    import hora
    from tests.faults import _die
    hora.init()
    buf = np.zeros(1, np.float32)
    try:
        for i in range(LOOP_CALLS):
            if i == at_call and hora.rank() == victim:
                _die(out)
            hora.allreduce_(buf, op=hora.Sum, name="scale.kill")
    except hora.HoraError as e:
        return {"at": time.time(), "error": type(e).__name__, "named": getattr(e, "rank", None),
                "rank_failed": isinstance(e, hora.HoraRankFailedError)}
    return {"at": None, "error": None, "named": None, "rank_failed": False}


if __name__ == "__main__":
    rank_main(*sys.argv[1:4])
