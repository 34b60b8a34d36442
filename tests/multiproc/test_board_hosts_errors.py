"""The boards across hosts when calls disagree, run long or lose a rank: a mismatch raises
the engine's error on every rank, names that differ end in the engine's deadlock error, a
long loop of mixed collectives keeps its results, and a dead rank (a worker, the second
host's leader, rank 0) fails the survivors' board calls within seconds, naming it, with
nothing left in /dev/shm.  Jobs on "hosts" of this machine (board_hosts_jobs.py)."""
import os
import signal
import time

import numpy as np
import pytest

import hora
from hora.core.engine.board_rules import PATIENCE_S
from tests.helpers import RawJob
from tests.multiproc.board_oracle import check_as_engine as _check_as_engine
from tests.multiproc.board_oracle import die_in_a_call as _die_in_a_call
from tests.multiproc.board_oracle import board_count as _board_count
from tests.multiproc.board_oracle import expected as _expected
from tests.multiproc.board_oracle import hora_files as _hora_files
from tests.multiproc.board_oracle import same_bits as _same_bits
from tests.multiproc.board_hosts_jobs import AUTO, E32, FOUR_ONES, HOSTS, OFF, ONE_THREE
from tests.multiproc.board_hosts_jobs import host_groups as _host_groups
from tests.multiproc.board_hosts_jobs import np_of as _np
from tests.multiproc.board_hosts_jobs import plane_of as _plane
from tests.multiproc.board_hosts_jobs import run_on as _run
from tests.multiproc.board_hosts_jobs import slots as _slots
from tests.multiproc.board_hosts_jobs import step_input as _x
from tests.multiproc.board_hosts_jobs import where as _where

pytestmark = pytest.mark.timeout(60)


# -- 3. mismatches: the engine's error on every rank -----------------------------------------
def _mismatch_cases(rank):
    """name -> the call ``rank`` makes; one rank disagrees with the others (a worker, the
    second host's leader, rank 0)."""
    f32 = np.float32
    return {
        "m.shape.3": lambda: hora.allreduce(np.ones(4 if rank == 3 else 3, f32), op=hora.Sum,
                                            name="m.shape.3"),
        "m.shape.1": lambda: hora.allreduce(np.ones((2, 2) if rank == 1 else (4,), f32),
                                            op=hora.Sum, name="m.shape.1"),
        "m.dtype.2": lambda: hora.allreduce(np.ones(4, np.int32 if rank == 2 else f32),
                                            op=hora.Sum, name="m.dtype.2"),
        "m.dtype.0": lambda: hora.allreduce(np.ones(2, np.int64 if rank == 0 else np.float64),
                                            op=hora.Sum, name="m.dtype.0"),
        "m.op.0": lambda: hora.allreduce(np.ones(4, f32), op=hora.Max if rank == 0 else hora.Sum,
                                         name="m.op.0"),
        "m.op.3": lambda: hora.allreduce(np.ones(4, f32), op=hora.Min if rank == 3 else hora.Sum,
                                         name="m.op.3"),
        "m.kind.3": lambda: (hora.allgather(np.ones(4, f32), name="m.kind.3") if rank == 3 else
                             hora.allreduce(np.ones(4, f32), op=hora.Sum, name="m.kind.3")),
        "m.barrier.2": lambda: (hora.barrier(name="m.barrier.2") if rank == 2 else
                                hora.allreduce(np.ones(2), op=hora.Sum, name="m.barrier.2")),
        "m.barrier.0": lambda: (hora.barrier(name="m.barrier.0") if rank == 0 else
                                hora.allreduce(np.ones(2), op=hora.Sum, name="m.barrier.0")),
        "m.big.3": lambda: hora.allreduce(np.ones(E32 + 1 if rank == 3 else 4, f32),
                                          op=hora.Sum, name="m.big.3"),
        "m.big.0": lambda: hora.allreduce(np.ones(E32 if rank == 0 else 4, f32), op=hora.Sum,
                                          name="m.big.0"),
        "m.inplace": lambda: hora.allreduce_(np.ones(4 + rank, f32), op=hora.Sum,
                                             name="m.inplace"),
        # what the engine does with these is its own business: the boards must agree with it
        "m.prescale": lambda: hora.allreduce(np.arange(4, dtype=f32) + rank, op=hora.Sum,
                                             prescale_factor=2.0 if rank == 1 else 1.0,
                                             name="m.prescale"),
        "m.postscale": lambda: hora.allreduce(np.arange(4, dtype=f32) + rank, op=hora.Sum,
                                              postscale_factor=2.0 if rank == 2 else 1.0,
                                              name="m.postscale"),
    }


def _mismatches():
    rank = hora.rank()
    out, lined = {}, {}
    for key, call in _mismatch_cases(rank).items():
        before = _board_count()
        hora.allreduce(np.ones(1), op=hora.Sum, name=f"before.{key}")   # line the ranks up
        t, lined[key] = time.monotonic(), _board_count() - before
        try:
            got = ("ok", np.asarray(call()).copy())
        except Exception as e:  # noqa: BLE001 - compared with the engine's below
            got = ("error", type(e).__name__, str(e))
        out[key] = (got, time.monotonic() - t, _board_count() - before - lined[key])
    before = _board_count()
    after = hora.allreduce(np.full(2, rank + 1.0), op=hora.Sum, name="after")
    lined["after"] = _board_count() - before
    planes = dict(hora.metrics()["data_plane"], lined=lined)
    # last: names that differ.  The engine matches calls by name; once the stall inspector
    # has asked (HORA_STALL_CHECK_TIME_SECONDS) it sees every rank waiting for a name another
    # rank did not submit, and fails both on every rank
    t = time.monotonic()
    try:
        hora.allreduce(np.ones(2), op=hora.Sum, name="n.b" if rank == 3 else "n.a")
        named = ("ok",)
    except Exception as e:  # noqa: BLE001 - compared with the engine's below
        named = ("error", type(e).__name__, str(e))
    return out, after, planes, (named, time.monotonic() - t)


STALL_S = 3.0
STALL = {"HORA_STALL_CHECK_TIME_SECONDS": "1", "HORA_STALL_SHUTDOWN_TIME_SECONDS": repr(STALL_S)}


# 2x2 (the hierarchical plane) and 1+3 (the TCP ring; rank 0 leads a board of one, rank 1 a
# board of three): between them a disagreeing rank is rank 0, a worker of rank 0's host, a
# leader of another host and a worker of another host.  4 hosts of one added no path of its
# own: a board of one (rank 0's in 1+3) under the same ring and the same rounds.
@pytest.mark.parametrize("hosts", [HOSTS, ONE_THREE], ids=["2x2", "1+3"])
def test_mismatched_calls_raise_the_engines_error_on_every_rank(hosts):
    """Shapes, dtypes, ops, kinds (an allgather, a barrier), sizes on either side of 64 KiB,
    scale factors: the engine's errors (or results) on every rank, by the same ranks
    disagreeing with the boards on and off; names that differ: the engine's stall, which it
    ends with an error on every rank (a deadlock: every rank waits for a name another did
    not submit) before HORA_STALL_SHUTDOWN_TIME_SECONDS would.  On 2 hosts of 2
    ranks, and on a host of one and a host of three."""
    on = _run(_mismatches, hosts=hosts, env=STALL)
    off = _run(_mismatches, hosts=hosts, env=dict(OFF, **STALL))
    n = len(on)
    for rank in range(n):
        got_on, after, planes, (named, named_took) = on[rank]
        named_off = off[rank][3][0]
        for got in (named_off, named):
            assert got[:2] == ("error", "CollectiveMismatchError") and "deadlocked" in got[2] \
                and "'n.a'" in got[2] and "'n.b'" in got[2], (rank, got)
        assert named_took < STALL_S + PATIENCE_S + 3.0, \
            f"rank {rank}: names that differ failed after {named_took:.1f} s"
        got_off = off[rank][0]
        for key, (res, took, board) in got_on.items():
            ref = got_off[key][0]
            assert took < 5.0, f"rank {rank} {key}: took {took:.1f} s"
            assert board == 0, f"rank {rank} {key}: counted on the board"
            _check_as_engine(rank, key, res, ref)
        _same_bits(after, np.full(2, float(sum(range(1, n + 1)))), f"rank {rank} after")
        # the lining-up calls and the last one went through the boards (counted on every rank
        # or on none; under load a rank may come to one of them later than the patience)
        planes = dict(planes)
        lined = planes.pop("lined")
        assert lined == on[0][2]["lined"], (rank, lined, on[0][2]["lined"])
        fell_back = [key for key, count in lined.items() if count != 1]
        assert len(fell_back) <= 1, f"rank {rank}: not on the board: {fell_back}"
        assert planes.get("board", 0) == len(lined) - len(fell_back), (rank, planes)


# -- 4. a 200-step loop of mixed collectives --------------------------------------------------
LARGE = E32 + 7             # float32: just above 64 KiB


def _bc(i, rank):
    return np.arange(4, dtype=np.float32) + 100 * rank + i


def _mixed(steps):
    """Each step: a blocking small allreduce, an asynchronous one held over a broadcast and a
    blocking small in-place one, a larger allreduce, a blocking grouped one; the board's count
    around each."""
    rank, size = hora.rank(), hora.size()
    out = []
    for i in range(steps):
        c0 = _board_count()
        a = hora.allreduce(_x(i, rank), op=hora.Sum, name=f"s.{i}")
        c1 = _board_count()
        h = hora.allreduce_async(np.full(5, rank + i, np.int64), op=hora.Max, name=f"as.{i}")
        b = hora.broadcast(_bc(i, rank), root_rank=i % size, name=f"b.{i}")
        c2 = _board_count()
        c = np.array([rank, i, 1], np.int64)
        hora.allreduce_(c, op=hora.Sum, name=f"c.{i}")
        c3 = _board_count()
        m = hora.synchronize(h)
        big = hora.allreduce(np.full(LARGE, float(rank + i), np.float32), op=hora.Sum,
                             name=f"L.{i}")
        c4 = _board_count()
        g = hora.grouped_allreduce([np.full(2, rank + i, np.float32),
                                    np.full(3, -rank - i, np.float32)], op=hora.Max,
                                   name=f"g.{i}")
        c5 = _board_count()
        out.append((a, b, c, m, big[[0, -1]].copy(), big.shape, g,
                    (c1 - c0, c2 - c1, c3 - c2, c4 - c3, c5 - c4)))
    return _where(), out, _board_count()


def _sleepy(steps):
    x = np.full(3, float(hora.rank()), np.float32)
    hora.barrier()
    before = _board_count()
    t0 = time.monotonic()
    for _ in range(steps):
        out = hora.allreduce(x, op=hora.Sum, name="sleepy")
    return out, time.monotonic() - t0, _board_count() - before


def test_waits_that_sleep_at_once_still_hear_the_other_hosts_at_once():
    """HORA_SPIN_TIME_US=0: rank 0 waiting for the other hosts' posts, and a leader waiting
    for rank 0's answer, sleep on their sockets at once (as they do once the spin budget
    is spent).  A message read by the engine step just before must not be slept through
    until the nap ends (2 ms, every call: 4.3 ms a call when it was; 0.2 ms now)."""
    steps = 200
    results = _run(_sleepy, args=(steps,), env={"HORA_SPIN_TIME_US": "0"})
    n = len(results)
    for rank, (out, took, board) in enumerate(results):
        _same_bits(out, np.full(3, n * (n - 1) / 2, np.float32), f"rank {rank}")
        assert board == steps, f"rank {rank}: {board} of {steps} calls on the board"
        assert took / steps < 1e-3, f"rank {rank}: {took / steps * 1e3:.2f} ms a call"


@pytest.mark.timeout(90)
def test_many_mixed_collectives():
    steps = 200
    results = _run(_mixed, args=(steps,), timeout_s=80)
    groups = _host_groups([r[0] for r in results])
    n = len(results)
    for rank, (_, outs, board) in enumerate(results):
        assert len(outs) == steps
        for i, (a, b, c, m, big, big_shape, g, deltas) in enumerate(outs):
            what = f"rank {rank} step {i}"
            _same_bits(a, _expected([_x(i, r) for r in range(n)], "Sum", groups=groups), what)
            _same_bits(b, _bc(i, i % n), f"{what} broadcast")
            _same_bits(c, np.array([n * (n - 1) // 2, n * i, n], np.int64), f"{what} c")
            _same_bits(m, np.full(5, n - 1 + i, np.int64), f"{what} async")
            assert big_shape == (LARGE,)
            _same_bits(big, np.full(2, float(n * i + n * (n - 1) // 2), np.float32),
                       f"{what} large")
            _same_bits(g[0], np.full(2, n - 1 + i, np.float32), f"{what} grouped[0]")
            _same_bits(g[1], np.full(3, -i, np.float32), f"{what} grouped[1]")
            small, held, small_inplace, large, grouped = deltas
            # the asynchronous one, the broadcast and the large one: never the board
            assert held == 0 and large == 0, (what, deltas)
            # the others: each counted on every rank or on none, once at most
            assert deltas == results[0][1][i][7], (what, deltas, results[0][1][i][7])
            assert small in (0, 1) and small_inplace in (0, 1) and grouped in (0, 1), \
                (what, deltas)
        assert board == results[0][2]
    assert results[0][2] > 0, "nothing went through the board"


# -- 6. a dead rank while the others wait on the boards ---------------------------------------
def _die_during_board(victim, how):
    """``victim`` dies (SIGKILL) while the others wait on the boards: before its call
    (``kill``: 0.5 s after a warm-up), or in it (``posted``: 0.3 s into the call, which rank
    1 joins only 1 s after the others; the victim's post, or its host's, is out by then)."""
    hora.init()
    rank = hora.rank()
    where = _where()
    hora.allreduce(np.ones(4), op=hora.Sum, name="warm")
    warm_board = _board_count()
    if how == "posted":
        if rank == victim:
            _die_in_a_call(0.3)
        elif rank == 1:
            time.sleep(1.0)
    elif rank == victim:
        time.sleep(0.5)                 # the others are waiting in the next call by now
        with open(os.environ["DEATH_FILE"], "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        hora.allreduce(np.ones(4), op=hora.Sum, name="lost")
        return ("finished", warm_board, where)
    except hora.HorovodInternalError as e:
        return (type(e).__name__, getattr(e, "rank", None), str(e), time.time(), warm_board,
                where)


# Every role dies before its call (kill) and in it (posted).  Two cases took no path of their
# own and are left out: 4x1's host 3 killed (a board of one that is not rank 0's, killed
# before its call: 4x1-host-2-posted kills one in its call, 1+3-leader-of-host-1 a leader of
# another host before it), and 1+3's worker of host 1 in its call (worker-of-host-1-posted:
# the same role in the same host rounds; the data plane serves no small call).
@pytest.mark.parametrize("hosts,victim,how", [
    (HOSTS, 3, "kill"), (HOSTS, 1, "kill"), (HOSTS, 2, "kill"), (HOSTS, 0, "kill"),
    (HOSTS, 3, "posted"), (HOSTS, 2, "posted"),
    (FOUR_ONES, 0, "kill"), (FOUR_ONES, 2, "posted"),
    (ONE_THREE, 1, "kill")],
    ids=["worker-of-host-1", "worker-of-host-0", "leader-of-host-1", "rank-0",
         "worker-of-host-1-posted", "leader-of-host-1-posted",
         "4x1-rank-0", "4x1-host-2-posted",
         "1+3-leader-of-host-1"])
def test_survivors_of_a_dead_rank_fail_naming_it_within_seconds(tmp_path, hosts, victim, how):
    death = tmp_path / "death"
    job = RawJob(_die_during_board, _np(hosts), tmp_path, args=(victim, how),
                 env=dict(AUTO, DEATH_FILE=str(death)), hosts=_slots(hosts))
    host_of = [name for name, count in _slots(hosts) for _ in range(count)]
    results = job.results(timeout_s=40)
    pids = {p.pid for p in job.procs}
    assert results[victim] is None, (results[victim], job.stderr(victim)[-2000:])
    assert death.exists(), f"rank {victim} did not die:\n{job.stderr(victim)[-2000:]}"
    killed_at = float(death.read_text())
    survived = {}
    for r, res in enumerate(results):
        if r != victim:
            assert res is not None and res[0] == "ok", (r, res, job.stderr(r)[-2000:])
            survived[r] = res[1]
    for r, got in survived.items():
        where = got[-1]
        assert where["plane"] == _plane(hosts) and where["host"] == host_of[r], (r, where)
    for r, got in survived.items():
        assert got[0] != "finished", f"rank {r}: the call finished without rank {victim}"
        kind, rank, message, at, warm_board, _ = got
        assert warm_board == 1, f"rank {r}: the warm-up did not go through the board"
        assert kind == "HoraRankFailedError" and rank == victim, (r, got)
        assert f"rank {victim}" in message, (r, message)
        assert at - killed_at < 5.0, f"rank {r} took {at - killed_at:.1f} s to notice"
    assert _hora_files(pids) == [], "segments left in /dev/shm"
