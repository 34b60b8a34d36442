"""Fault scenarios, defined once: the tests assert them, ``tools/reliability_report.py``
runs them and writes ``docs/reliability.md``.

A scenario breaks a real job on purpose at one phase: a rank kills itself with SIGKILL
(before init completes, during negotiation, mid-ring allreduce, mid-broadcast, in user code,
in the torch optimizer step), a rank resets or closes one of its TCP connections, the
coordinator dies, or the harness pauses a rank with SIGSTOP past the stall threshold.

Each scenario runs twice:

- :func:`run_raw`: ranks started by hand (``tests.helpers.RawJob``), so that the survivors
  live on and report what they saw: the error type, the rank it names, and when they
  noticed (detection time = that moment minus the moment of the fault, which the faulty rank
  wrote to a file just before).
- :func:`run_launcher`: the same ranks under ``hora run``, which must exit non-zero naming
  the rank, and leave no process (found by a marker in their environment) and no
  ``/dev/shm/hora-<pid>-*`` segment behind.

Run one by hand: ``python -m tests.faults <scenario>``.
"""
import ctypes
import dataclasses
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np

__all__ = ["Scenario", "SCENARIOS", "Outcome", "run_raw", "run_launcher", "leftovers",
           "GOAL_S", "LIMIT_S"]

GOAL_S = 5.0            # detection goal (issue 5)
LIMIT_S = 10.0          # detection hard limit
ROOT = Path(__file__).resolve().parent.parent
_BIG = 8 << 20          # float32 elements: a 32 MiB buffer


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One way to break a job.

    Attributes:
        name: identifier (also the worker's entry point: ``_phase_<name>``).
        what: one line for the report.
        np: ranks.
        fault_rank: the rank that dies or breaks a connection (None: the harness acts).
        blamed: ranks an error may name (the dead rank; either end of a broken connection).
        env: extra settings for the job.
        launcher: also run it under ``hora run``.
        expect: "fail" (every survivor raises naming a blamed rank) or "complete".
        linger_s: survivors stay alive after their error, as an elastic job's would
            (nothing closes their connections by exiting), until every other rank has
            noticed the fault too or is dead, for at most this long; detection must then
            meet the goal, not just the limit.
    """
    name: str
    what: str
    np: int
    fault_rank: int = None
    blamed: tuple = ()
    env: tuple = ()
    launcher: bool = True
    expect: str = "fail"
    linger_s: float = 0.0


SCENARIOS = [
    Scenario("init", "SIGKILL during hora.init() (registered, before connecting)", 3, 1, (1,),
             env=(("HORA_START_TIMEOUT", "8"),)),
    Scenario("negotiation", "SIGKILL with a request at the coordinator, others waiting", 3, 2,
             (2,)),
    Scenario("ring_allreduce", "SIGKILL mid-ring allreduce (32 MiB, tcp backend)", 3, 1, (1,),
             env=(("HORA_BACKEND", "tcp"),)),
    Scenario("shm_allreduce", "SIGKILL mid-allreduce (32 MiB, shared-memory backend)", 3, 1,
             (1,)),
    Scenario("shm_owner_left", "SIGKILL mid-allreduce (shared memory) while a survivor "
             "reads another survivor's buffer, freed as it left", 3, 1, (1,),
             launcher=False, linger_s=2.5),
    Scenario("broadcast", "SIGKILL mid-broadcast (32 MiB from rank 0, tcp backend)", 3, 2,
             (2,), env=(("HORA_BACKEND", "tcp"),)),
    Scenario("user_code", "SIGKILL in user code; survivors waiting in an allreduce", 3, 2,
             (2,)),
    Scenario("user_code_idle", "SIGKILL in user code; survivors also in user code", 3, 1, (1,)),
    Scenario("optimizer_step", "SIGKILL inside torch DistributedOptimizer.step()", 3, 1, (1,),
             env=(("HORA_BACKEND", "tcp"),)),
    Scenario("coordinator", "SIGKILL of rank 0 (the coordinator) in user code", 4, 0, (0,)),
    Scenario("coordinator_allreduce", "SIGKILL of rank 0 mid-ring allreduce (tcp)", 3, 0, (0,),
             env=(("HORA_BACKEND", "tcp"),)),
    Scenario("tcp_reset", "one TCP data connection reset (RST) mid-allreduce; ranks live on",
             3, 1, (1, 2), env=(("HORA_BACKEND", "tcp"),), launcher=False, linger_s=6.0),
    Scenario("tcp_close", "one TCP data connection shut down (FIN) mid-allreduce; ranks live "
             "on", 3, 1, (1, 2), env=(("HORA_BACKEND", "tcp"),), launcher=False, linger_s=6.0),
    Scenario("sigstop", "SIGSTOP a rank 3.5 s past a 1 s stall threshold, then SIGCONT", 3,
             None, (1,), env=(("HORA_STALL_CHECK_TIME_SECONDS", "1"),), launcher=False,
             expect="complete"),
]
BY_NAME = {s.name: s for s in SCENARIOS}


@dataclasses.dataclass
class Outcome:
    """What one run of a scenario showed."""
    scenario: str
    mode: str                       # "raw" or "launcher"
    ok: bool = False
    summary: str = ""
    errors: dict = dataclasses.field(default_factory=dict)      # rank -> (type, named rank)
    detection_s: float = None       # slowest survivor (raw) / launcher exit (launcher)
    leftovers: list = dataclasses.field(default_factory=list)
    problems: list = dataclasses.field(default_factory=list)
    log: str = ""


# -- inside the ranks ----------------------------------------------------------------------
def _publish(path, text):
    """Write ``text`` to ``path`` whole or not at all: the harness polls for the file and
    reads it at once, which could otherwise catch it created but still empty."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _mark_fault(out):
    _publish(Path(out) / "fault", repr(time.time()))


def _die(out):
    _mark_fault(out)
    os.kill(os.getpid(), signal.SIGKILL)


def _die_soon(out, delay):
    def run():
        time.sleep(delay)
        _die(out)
    threading.Thread(target=run, daemon=True).start()


def _reset_soon(out, peer, how, delay):
    """From a thread of this rank: break our data connection to ``peer`` mid-transfer."""
    import hora.core.state as state

    def run():
        time.sleep(delay)
        sock = state.engine()._t._socks[peer]
        _mark_fault(out)
        if how == "reset":      # connect(AF_UNSPEC) disconnects a TCP socket with a RST
            libc = ctypes.CDLL(None, use_errno=True)
            addr = struct.pack("H14s", socket.AF_UNSPEC, b"")
            libc.connect(sock.fileno(), addr, len(addr))
        else:
            sock.shutdown(socket.SHUT_RDWR)
    threading.Thread(target=run, daemon=True).start()


def _loop(fn, count=200):
    for i in range(count):
        fn(i)


def _phase_init(sc, rank, out):
    import hora
    import hora.core.bootstrap as bootstrap
    if rank == sc.fault_rank:
        real = bootstrap._dial
        bootstrap._dial = lambda *a, **k: _die(out) or real(*a, **k)
    hora.init()
    return hora.allreduce(np.ones(2), name="never")


def _warm():
    import hora
    hora.init()
    hora.allreduce(np.ones(1), name="warmup")
    return hora.rank()


def _phase_negotiation(sc, rank, out):
    import hora
    _warm()
    if rank == sc.fault_rank:
        time.sleep(0.3)
        hora.allreduce_async(np.ones(4), name="neg.other")   # reaches the coordinator
        time.sleep(0.05)
        _die(out)
    return hora.allreduce(np.ones(4), name="neg.x")


def _phase_ring_allreduce(sc, rank, out):
    import hora
    _warm()
    data = np.ones(_BIG, np.float32)
    if rank == sc.fault_rank:
        _die_soon(out, 0.05)
    _loop(lambda i: hora.allreduce(data, name=f"big.{i}"))


_phase_shm_allreduce = _phase_ring_allreduce
_phase_coordinator_allreduce = _phase_ring_allreduce


def _die_holding_sockets(out, hold_s):
    """SIGKILL this rank while a child of it keeps its connections open for ``hold_s``: its
    memory is gone (``process_vm_readv`` says ESRCH) before any peer sees it hang up, as
    when a killed process is slow to close its files."""
    holder = Path(out) / "holder"           # its pid: the survivors linger till it ends
    if os.fork() == 0:
        _publish(holder, str(os.getpid()))
        time.sleep(hold_s)
        os._exit(0)
    deadline = time.monotonic() + 5
    while not holder.exists() and time.monotonic() < deadline:
        time.sleep(0.001)
    _die(out)


def _phase_shm_owner_left(sc, rank, out):
    """Rank 1 dies once every rank has published its buffer; rank 0 reads it gone and
    leaves the collective, which frees rank 0's buffer; rank 2 reads that buffer last,
    finds it unmapped (EFAULT), and must still name rank 1, whose sockets are still open.
    (A CI run saw this order by chance; here a child holds rank 1's sockets, and ranks 0
    and 2 start their reads late.)  The failed collective's handle must be done: the
    engine fails it with the others, not its waiter a second later."""
    import hora
    from hora.backends import cma
    _warm()
    data = np.ones(_BIG, np.float32)
    hora.allreduce(data, name="first")     # (the first also tries the reads: cma.probe)
    read = cma.read

    def first_read(*args):
        cma.read = read
        if rank == sc.fault_rank:
            _die_holding_sockets(out, 1.0)
        time.sleep(0.2 if rank == 0 else 0.4)
        return read(*args)
    cma.read = first_read
    handle = hora.allreduce_async(data, name="big")
    try:
        return hora.synchronize(handle)
    except hora.HoraError as e:
        if not hora.poll(handle):       # (its waiter would notice only at its next look)
            raise RuntimeError(f"rank {rank}: the failed allreduce's handle is not done "
                               f"({e})") from e
        raise


def _phase_broadcast(sc, rank, out):
    import hora
    _warm()
    data = np.ones(_BIG, np.float32)
    if rank == sc.fault_rank:
        _die_soon(out, 0.05)
    _loop(lambda i: hora.broadcast(data, root_rank=0, name=f"bcast.{i}"))


def _phase_user_code(sc, rank, out):
    import hora
    _warm()
    if rank == sc.fault_rank:
        time.sleep(0.5)             # the others are waiting in the allreduce by now
        _die(out)
    return hora.allreduce(np.ones(4), name="after")


_phase_coordinator = _phase_user_code


def _phase_user_code_idle(sc, rank, out):
    import hora
    import hora.core.state as state
    _warm()
    if rank == sc.fault_rank:
        time.sleep(0.3)
        _die(out)
    deadline = time.monotonic() + 2 * LIMIT_S
    while state.engine().alive and time.monotonic() < deadline:
        time.sleep(0.01)            # "training" without any collective in flight
    noticed = time.time()
    try:
        hora.allreduce(np.ones(4), name="after")
    except hora.HorovodInternalError as e:
        e.noticed = noticed         # the engine knew before the user asked
        raise
    return "no error"


def _phase_optimizer_step(sc, rank, out):
    import torch

    import hora.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 256))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    real_step = opt.step

    def step(*args, **kwargs):
        if rank == sc.fault_rank and step.calls == 3:
            _die_soon(out, 0.002)   # while this rank is inside step()
        step.calls += 1
        return real_step(*args, **kwargs)
    step.calls = 0
    opt.step = step
    x = torch.randn(64, 256)
    for _ in range(200):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def _phase_tcp_reset(sc, rank, out, how="reset"):
    import hora
    _warm()
    data = np.ones(_BIG, np.float32)
    if rank == sc.fault_rank:
        _reset_soon(out, 2, how, 0.05)
    _loop(lambda i: hora.allreduce(data, name=f"big.{i}"))


def _phase_tcp_close(sc, rank, out):
    _phase_tcp_reset(sc, rank, out, how="close")


def _phase_sigstop(sc, rank, out):
    import hora
    _warm()
    results = []
    for step in range(3):
        if rank == 1 and step == 1:
            _publish(Path(out) / "ready", str(os.getpid()))
            time.sleep(0.5)         # the harness stops us here, in user code
        results.append(hora.allreduce(np.full(3, rank + step, np.float64), op=hora.Sum,
                                      name=f"step.{step}"))
    return results


def worker(name, out):
    """One rank of scenario ``name``: returns its result or the error it saw (a dict)."""
    import hora
    sc = BY_NAME[name]
    rank = int(os.environ["HORA_RANK"])
    _publish(Path(out) / f"pid.{rank}", str(os.getpid()))
    try:
        value = globals()[f"_phase_{name}"](sc, rank, out)
        return {"result": value}
    except hora.HoraError as e:
        seen = {"error": type(e).__name__, "rank": getattr(e, "rank", None),
                "message": str(e), "at": getattr(e, "noticed", time.time()),
                "internal": isinstance(e, hora.HorovodInternalError)}
        _publish(Path(out) / f"noticed.{rank}", repr(seen["at"]))
        _linger(sc, rank, out)
        return seen


def _linger(sc, rank, out):
    """Stay alive (connections open) until every other rank has noticed the fault too or is
    dead, and a child holding a dead rank's connections (:func:`_die_holding_sockets`) has
    ended, at most ``sc.linger_s``: a rank that exits closes its connections, which would
    tell the others what they must find out by themselves."""
    from tests.helpers import pid_alive

    def alive(name):
        pid = Path(out) / name
        return pid.exists() and pid_alive(int(pid.read_text()))

    def pending(r):
        return not (Path(out) / f"noticed.{r}").exists() and (
            not (Path(out) / f"pid.{r}").exists() or alive(f"pid.{r}"))
    deadline = time.monotonic() + sc.linger_s
    while time.monotonic() < deadline and (
            alive("holder") or any(pending(r) for r in range(sc.np) if r != rank)):
        time.sleep(0.02)


# -- the harness ---------------------------------------------------------------------------
def leftovers(tag, pids):
    """Processes whose environment carries ``tag`` and shm segments made by ``pids``."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if tag.encode() in (d / "environ").read_bytes():
                found.append(f"process {d.name}")
        except OSError:
            continue
    prefixes = tuple(f"hora-{p}-" for p in pids)
    if prefixes and os.path.isdir("/dev/shm"):
        found += [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith(prefixes)]
    return found


def _env(sc, tag):
    return {**dict(sc.env), "HORA_FAULT_TAG": tag}


def _read_fault(out):
    f = Path(out) / "fault"
    return float(f.read_text()) if f.exists() else None


def _pids(out):
    return [int(p.read_text()) for p in Path(out).glob("pid.*")]


def _sigstop_harness(job, out, outcome):
    ready = Path(out) / "ready"
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not ready.exists():
        outcome.problems.append("rank 1 never reached the pause point")
        return
    pid = int(ready.read_text())
    os.kill(pid, signal.SIGSTOP)
    _mark_fault(out)
    stopped = time.monotonic()
    while time.monotonic() - stopped < 3.5:
        if outcome.detection_s is None and "Missing ranks:\n1:" in job.stderr(0):
            outcome.detection_s = time.monotonic() - stopped     # first warning seen
        time.sleep(0.02)
    os.kill(pid, signal.SIGCONT)


def run_raw(sc, tmp):
    """Run ``sc`` with hand-started ranks; return an :class:`Outcome`."""
    from functools import partial

    from tests.helpers import RawJob
    out = Path(tmp)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"hora-fault-{uuid.uuid4().hex}"
    outcome = Outcome(sc.name, "raw")
    job = RawJob(partial(worker, sc.name, str(out)), sc.np, out, env=_env(sc, tag))
    if sc.name == "sigstop":
        _sigstop_harness(job, out, outcome)
    try:
        results = job.results(timeout_s=60)
    except AssertionError as e:
        outcome.problems.append(f"hung: {e}")
        return outcome
    fault = _read_fault(out)
    outcome.leftovers = leftovers(tag, _pids(out))
    outcome.log = job.stderr(0)
    if sc.expect == "complete":
        _check_complete(sc, results, outcome, fault)
    else:
        _check_failed(sc, results, outcome, fault)
    if outcome.leftovers:
        outcome.problems.append(f"left behind: {outcome.leftovers}")
    outcome.ok = not outcome.problems
    return outcome


def _check_failed(sc, results, outcome, fault):
    if fault is None:
        outcome.problems.append("the fault never happened")
        return
    times = []
    for r, res in enumerate(results):
        if r == sc.fault_rank and res is None:
            continue                    # killed: no result
        if res is None or res[0] != "ok":
            outcome.problems.append(f"rank {r} crashed: {res and res[1:3]}")
            continue
        got = res[1]
        if "error" not in got:
            if r != sc.fault_rank:
                outcome.problems.append(f"rank {r} saw no error: {got}")
            continue
        outcome.errors[r] = (got["error"], got["rank"])
        if got["rank"] not in sc.blamed or f"rank {got['rank']}" not in got["message"]:
            outcome.problems.append(f"rank {r} blamed rank {got['rank']}: {got['message']}")
        if sc.name != "init" and not got["internal"]:
            outcome.problems.append(f"rank {r}: {got['error']} is not a HorovodInternalError")
        times.append(got["at"] - fault)
    if times:
        outcome.detection_s = max(times)
        bound = GOAL_S if sc.linger_s else LIMIT_S
        if outcome.detection_s > bound:
            outcome.problems.append(f"detection took {outcome.detection_s:.1f} s (> {bound:g})")
    kinds = sorted({f"{k} naming rank {r}" for k, r in outcome.errors.values()})
    outcome.summary = "; ".join(kinds) or "no survivor error"


def _check_complete(sc, results, outcome, fault):
    for r, res in enumerate(results):
        if res is None or res[0] != "ok" or "result" not in res[1]:
            outcome.problems.append(f"rank {r} did not complete: {res}")
            continue
        want = [np.full(3, sum(q + step for q in range(sc.np)), np.float64) for step in range(3)]
        for got, exp in zip(res[1]["result"], want):
            if not np.array_equal(got, exp):
                outcome.problems.append(f"rank {r}: wrong result {got} != {exp}")
    log = outcome.log
    named = "Missing ranks:\n1: [step.1]" in log
    stack = "in _phase_sigstop" in log          # its stack, once SIGCONT let it answer
    silent = "rank 1: no answer after" in log
    if not named:
        outcome.problems.append("no stall warning naming rank 1")
    if not (stack and silent):
        outcome.problems.append("the warning did not report rank 1 silent, then its stack")
    outcome.summary = (f"warned {log.count('Missing ranks:')} times naming rank 1 (no stack "
                       f"answer while stopped, its stack after SIGCONT); completed, results "
                       f"correct" if not outcome.problems else "")


def run_launcher(sc, tmp):
    """Run ``sc`` under ``hora run``; return an :class:`Outcome` (detection = launcher exit
    minus the fault)."""
    out = Path(tmp)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"hora-fault-{uuid.uuid4().hex}"
    outcome = Outcome(sc.name, "launcher")
    env = {**os.environ, **_env(sc, tag),
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, sys.path)])}
    cmd = [sys.executable, "-m", "hora", "run", "-np", str(sc.np), "--timeout", "60",
           sys.executable, "-m", "tests.faults", "--worker", sc.name, str(out)]
    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        outcome.problems.append("hora run did not exit within 90 s")
        return outcome
    ended = time.time()
    fault = _read_fault(out)
    outcome.log = proc.stderr
    outcome.leftovers = leftovers(tag, _pids(out))
    if proc.returncode == 0:
        outcome.problems.append("hora run exited 0")
    victim = f"rank {sc.fault_rank} (pid"
    if victim not in proc.stderr or "SIGKILL" not in proc.stderr:
        outcome.problems.append(f"hora run did not name rank {sc.fault_rank}: "
                                f"{proc.stderr[-500:]}")
    if fault is not None:
        outcome.detection_s = ended - fault
        if outcome.detection_s > LIMIT_S:
            outcome.problems.append(f"hora run took {outcome.detection_s:.1f} s to exit")
    else:
        outcome.problems.append("the fault never happened")
    if outcome.leftovers:
        outcome.problems.append(f"left behind: {outcome.leftovers}")
    outcome.summary = f"exit {proc.returncode}, names rank {sc.fault_rank} (SIGKILL)"
    outcome.ok = not outcome.problems
    return outcome


if __name__ == "__main__":
    import tests.faults as faults       # the importable module, not __main__
    if sys.argv[1] == "--worker":       # one rank under `hora run`
        faults.worker(sys.argv[2], sys.argv[3])
    else:
        import tempfile
        for name in sys.argv[1:]:
            for run in (faults.run_raw, faults.run_launcher):
                if run is faults.run_launcher and not BY_NAME[name].launcher:
                    continue
                with tempfile.TemporaryDirectory() as d:
                    o = run(BY_NAME[name], d)
                    print(o.scenario, o.mode, "ok" if o.ok else "FAILED", o.summary,
                          o.detection_s, o.problems)
