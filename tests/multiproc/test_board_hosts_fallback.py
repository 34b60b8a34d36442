"""The boards across hosts fall back to the engine together whenever they cannot settle a call
for certain (a rank's call is asynchronous or late, a rank has joined, a leader vetoed the
round), then settle on the boards again; barriers wait for the last rank of either host;
process sets go through the engine.  Jobs on "hosts" of this machine (board_hosts_jobs.py).
"""
import time

import numpy as np
import pytest

import hora
from tests.helpers import run_sections
from tests.multiproc.board_oracle import board_count as _board_count
from tests.multiproc.board_oracle import expected as _expected
from tests.multiproc.board_oracle import fallbacks as _fallbacks
from tests.multiproc.board_oracle import fallbacks_since as _fallbacks_since
from tests.multiproc.board_oracle import same_bits as _same_bits
from tests.multiproc.board_hosts_jobs import THREE_HOSTS
from tests.multiproc.board_hosts_jobs import host_groups as _host_groups
from tests.multiproc.board_hosts_jobs import run_on as _run
from tests.multiproc.board_hosts_jobs import step_input as _x
from tests.multiproc.board_hosts_jobs import where as _where

pytestmark = pytest.mark.timeout(60)


# -- 2. fallbacks, barriers, process sets: one job, one section each ------------------------
ASYNC_RANKS = [3, 2, 0, 1]      # in turn: a worker, the second host's leader, rank 0, a worker
ASYNC_STEPS = 4


def _async_section():
    """Name ``m.k``: one rank submits it asynchronously, every other rank blocks; a plain
    blocking call ``p.k`` after it.  Each call's growth of the board's count."""
    rank = hora.rank()
    out = []
    for phase, async_rank in enumerate(ASYNC_RANKS):
        for i in range(ASYNC_STEPS):
            k = phase * ASYNC_STEPS + i
            before = _board_count()
            t = time.monotonic()
            if rank == async_rank:
                h = hora.allreduce_async(_x(k, rank), op=hora.Sum, name=f"m.{k}")
                if i % 2:
                    time.sleep(0.01)
                m = hora.synchronize(h)
            else:
                m = hora.allreduce(_x(k, rank), op=hora.Sum, name=f"m.{k}")
            took = time.monotonic() - t
            mid = _board_count()
            p = hora.allreduce(_x(k, rank, 2), op=hora.Max, name=f"p.{k}")
            out.append((m, mid - before, p, _board_count() - mid, took))
    return out


LATE = [(3, 1.5), (2, 1.5), (1, 1.5), (0, 2.5)]     # (late rank, seconds late)


def _late_calls(schedule, prefix):
    """For each ``(late rank, delay)`` of ``schedule``: a warm-up call, then ``prefix.k``,
    which the late rank comes to ``delay`` seconds after the others; yields ``k``, the
    result, the growth of the board's count and the seconds the call took."""
    rank = hora.rank()
    for k, (late, delay) in enumerate(schedule):
        hora.allreduce(np.ones(1), op=hora.Sum, name=f"{prefix}.warm.{k}")
        if rank == late:
            time.sleep(delay)
        before, t = _board_count(), time.monotonic()
        got = hora.allreduce(_x(k, rank), op=hora.Sum, name=f"{prefix}.{k}")
        yield k, got, _board_count() - before, time.monotonic() - t


def _late_section():
    """In turn, one rank comes to ``late.k`` later than the board's patience."""
    rank = hora.rank()
    out = []
    for k, first, board, took in _late_calls(LATE, "late"):
        second = hora.allreduce(_x(k + 10, rank), op=hora.Min, name=f"late.next.{k}")
        out.append((first, board, took, second))
    return out


JOINERS = [3, 2, 0]
JOIN_STEPS = 4


def _join_section():
    """In turn, one rank joins at once while the others make allreduces (Horovod's join: it
    adds zeros); then every rank makes 3 more once all have joined."""
    rank = hora.rank()
    out = []
    for k, joiner in enumerate(JOINERS):
        hora.allreduce(np.ones(1), op=hora.Sum, name=f"join.warm.{k}")
        outs, deltas = [], []
        if rank != joiner:
            for i in range(JOIN_STEPS):
                op = hora.Sum if i % 2 == 0 else hora.Average
                before = _board_count()
                outs.append(hora.allreduce(_x(20 * k + i, rank), op=op, name=f"j.{k}.{i}"))
                deltas.append(_board_count() - before)
                if i == 0:
                    time.sleep(0.05)        # the joiner has joined by now, on some steps
        last = hora.join()
        before, why = _board_count(), _fallbacks()
        after = [hora.allreduce(_x(100 + 10 * k + i, rank), op=hora.Sum,
                                name=f"after.{k}.{i}") for i in range(3)]
        out.append((outs, deltas, last, after, _board_count() - before, _fallbacks_since(why)))
    return out


SET_A, SET_B = [1, 2, 3], [0, 3]


def _sets_section():
    """Small blocking allreduces on two process sets (the engine's), and on the global set
    between them."""
    rank = hora.rank()
    a_set, b_set = hora.add_process_set(SET_A), hora.add_process_set(SET_B)
    out = []
    for i in range(4):
        before = _board_count()
        a = (hora.allreduce(_x(i, rank), op=hora.Sum, name=f"ps.a.{i}", process_set=a_set)
             if rank in SET_A else None)
        b = (hora.allreduce(_x(i, rank), op=hora.Max, name=f"ps.b.{i}", process_set=b_set)
             if rank in SET_B else None)
        mid = _board_count()
        g = hora.allreduce(_x(i, rank), op=hora.Sum, name=f"ps.g.{i}")
        out.append((a, b, mid - before, g, _board_count() - mid))
    hora.remove_process_set(a_set)
    hora.remove_process_set(b_set)
    return out


BARRIER_LATE = [(3, 0.3), (2, 0.3), (0, 0.3), (1, 0.3), (2, 1.5)]   # the last: past patience
BARRIER_MORE = 50


def _barrier_section():
    """In turn, one rank comes late to a barrier; then many barriers in a row."""
    rank = hora.rank()
    counts0, board0 = hora.metrics()["collectives"].get("barrier", 0), _board_count()
    stamps = []
    for late, delay in BARRIER_LATE:
        hora.barrier()
        if rank == late:
            time.sleep(delay)
        arrived = time.time()
        hora.barrier()
        stamps.append((arrived, time.time()))
    for _ in range(BARRIER_MORE):
        hora.barrier()
    counts = hora.metrics()["collectives"].get("barrier", 0) - counts0
    return stamps, counts, _board_count() - board0


def _fallbacks_worker():
    return _where(), run_sections({
        "barriers": _barrier_section,
        "async": _async_section,
        "late": _late_section,
        "join": _join_section,
        "sets": _sets_section,
    })


THREE_LATE = [(4, 1.5), (5, 1.5), (0, 1.5)]   # the third host's leader, its worker, rank 0
THREE_ASYNC = [3, 4]                           # the second host's worker, the third's leader


def _three_hosts_worker():
    """On 3 hosts, where the leaders hear each other through rank 0: one rank past the
    boards' patience, then one rank asynchronous, then plain blocking calls; each call's
    result, the growth of the board's count, and how long it took."""
    rank = hora.rank()
    out = [("late", *call, None) for call in _late_calls(THREE_LATE, "t.late")]
    for k, async_rank in enumerate(THREE_ASYNC):
        before, why, t = _board_count(), _fallbacks(), time.monotonic()
        if rank == async_rank:
            got = hora.synchronize(hora.allreduce_async(_x(k, rank), op=hora.Sum,
                                                        name=f"t.async.{k}"))
        else:
            got = hora.allreduce(_x(k, rank), op=hora.Sum, name=f"t.async.{k}")
        out.append(("async", k, got, _board_count() - before, time.monotonic() - t,
                    _fallbacks_since(why)))
    for k in range(20):
        before, why, t = _board_count(), _fallbacks(), time.monotonic()
        got = hora.allreduce(_x(k, rank), op=hora.Max if k % 2 else hora.Sum,
                             name=f"t.plain.{k % 3}")
        out.append(("plain", k, got, _board_count() - before, time.monotonic() - t,
                    _fallbacks_since(why)))
    return _where(), out


@pytest.mark.timeout(120)
def test_three_hosts_fall_back_together_and_settle_on_the_boards_again():
    """A veto or a leader's plea to veto travels from one leader to the others through rank
    0: a rank past the patience, or asynchronous, sends every host to the engine within the
    usual bounds, with the engine's results; plain calls then settle on the boards again."""
    got = _run(_three_hosts_worker, hosts=THREE_HOSTS, timeout_s=100)
    groups = _host_groups([r[0] for r in got], THREE_HOSTS)
    n = len(got)

    def seen(i):
        """Call ``i`` as every rank saw it: seconds, and why the board passed."""
        return {r: (round(out[i][4], 3), out[i][5]) for r, (_, out) in enumerate(got)}

    for rank, (_, out) in enumerate(got):
        for i, (kind, k, value, board, took, _) in enumerate(out):
            what = f"rank {rank}: {kind} {k} (by rank: {seen(i)})"
            op = "Max" if kind == "plain" and k % 2 else "Sum"
            _same_bits(value, _expected([_x(k, r) for r in range(n)], op, groups=groups),
                       what)
            if kind == "late":
                late, delay = THREE_LATE[k]
                assert board == 0, f"{what}: counted on the board"
                if rank != late:
                    assert took < delay + 0.5, f"{what}: took {took:.2f} s"
            elif kind == "async":
                assert board == 0, f"{what}: counted on the board"
                assert took < 0.5, f"{what}: took {took:.2f} s"
                # the metrics say why: a blocking call passed from the board to the engine,
                # the asynchronous one never came to the board
                passed = sum(c for why, c in out[i][5].items() if not why.startswith("idle"))
                assert passed == (0 if rank == THREE_ASYNC[k] else 1), what
        plain = [(board, why) for kind, _, _, board, _, why in out if kind == "plain"]
        assert sum(b for b, _ in plain) >= len(plain) - 2, f"rank {rank}: boards settled {plain}"


VETO_ASYNC, VETO_LATE = 3, 2        # the second host's worker, and its leader
VETO_SLEEP_S = 0.7                  # past the leader's engine's idle look (_IDLE_LOOK_S)


def _veto_worker():
    """Rank 3 asynchronous, rank 2 late: rank 0 vetoes the round before it posts (busy with
    rank 3's request while it waits for rank 1's post) while rank 2 sleeps, whose engine
    hears the veto before rank 2 comes to the call; each rank's seconds in the call and its
    board fallbacks, for 3 such calls."""
    rank = hora.rank()
    out = []
    for k in range(3):
        hora.allreduce(np.ones(1), op=hora.Sum, name=f"v.warm.{k}")
        if rank == VETO_LATE:
            time.sleep(VETO_SLEEP_S)
        elif rank == 1:     # rank 0 still waits for rank 1's post when rank 3's request comes
            time.sleep(0.1)
        why, t = _fallbacks(), time.monotonic()
        if rank == VETO_ASYNC:
            got = hora.synchronize(hora.allreduce_async(_x(k, rank), op=hora.Sum,
                                                        name=f"v.{k}"))
        else:
            got = hora.allreduce(_x(k, rank), op=hora.Sum, name=f"v.{k}")
        out.append((got, time.monotonic() - t, _fallbacks_since(why)))
    return _where(), out


@pytest.mark.timeout(60)
def test_a_leader_that_heard_the_veto_before_its_call_goes_to_the_engine_at_once():
    """Rank 0 vetoes a round (a rank of the other host is asynchronous) while that host's
    leader is elsewhere; its engine hears the veto, and when the leader comes to the call it
    goes to the engine at once (the veto names the call), rather than post the next round,
    which nobody else plays, and wait the boards' patience for it."""
    got = _run(_veto_worker, timeout_s=45)
    groups = _host_groups([r[0] for r in got])
    n = len(got)
    for k in range(3):
        seen = {r: (round(out[k][1], 3), out[k][2]) for r, (_, out) in enumerate(got)}
        for rank, (_, out) in enumerate(got):
            value, took, why = out[k]
            _same_bits(value, _expected([_x(k, r) for r in range(n)], "Sum", groups=groups),
                       f"rank {rank}: v.{k}")
        took, why = seen[VETO_LATE]
        assert took < 0.5, f"v.{k}: the late leader waited (by rank: {seen})"
        assert why.get("retreat", 0) + why.get("vetoed", 0) == 1, f"v.{k}: {seen}"


@pytest.fixture(scope="module")
def fallbacks():
    """The fallbacks job, run once for the tests of its sections."""
    got = []

    def get(name):
        if not got:
            try:
                got.append(_run(_fallbacks_worker, timeout_s=55))
            except Exception as e:  # noqa: BLE001 - reported by each test that needs it
                got.append(e)
        if isinstance(got[0], Exception):
            pytest.fail(f"the fallbacks job failed: {got[0]!r}")
        groups = _host_groups([r[0] for r in got[0]])
        results = []
        for rank, (_, sections) in enumerate(got[0]):
            status, value = sections[name]
            if status == "error":
                pytest.fail(f"section {name!r} raised on rank {rank}:\n{value}")
            results.append(value)
        return groups, results
    return get


@pytest.mark.timeout(90)
def test_barriers_wait_for_the_last_rank_of_either_host(fallbacks):
    groups, results = fallbacks("barriers")
    for k, (late, delay) in enumerate(BARRIER_LATE):
        late_arrival = results[late][0][k][0]
        for rank, (stamps, _, _) in enumerate(results):
            # nobody leaves the barrier before the late rank came to it (one machine: one clock)
            left = stamps[k][1]
            assert left >= late_arrival, (k, late, rank, left, late_arrival)
    for rank, (_, counts, board) in enumerate(results):
        assert counts == 2 * len(BARRIER_LATE) + BARRIER_MORE, (rank, counts)
        assert board == 0, f"rank {rank}: barriers counted as allreduces on the board ({board})"


@pytest.mark.timeout(90)
def test_one_rank_async_the_others_blocking_fall_back_to_the_engine(fallbacks):
    groups, results = fallbacks("async")
    n = len(results)
    for rank, outs in enumerate(results):
        assert len(outs) == len(ASYNC_RANKS) * ASYNC_STEPS
        for k, (m, m_board, p, p_board, took) in enumerate(outs):
            _same_bits(m, _expected([_x(k, r) for r in range(n)], "Sum", groups=groups),
                       f"rank {rank} m.{k}")
            _same_bits(p, _expected([_x(k, r, 2) for r in range(n)], "Max", groups=groups),
                       f"rank {rank} p.{k}")
            assert m_board == 0, f"rank {rank} m.{k} (asynchronous on rank " \
                f"{ASYNC_RANKS[k // ASYNC_STEPS]}) counted on the board"
            # a call the boards settled is counted on every rank, one they did not on none
            assert p_board == results[0][k][3] and p_board in (0, 1), \
                (rank, k, p_board, results[0][k][3])
            # the engine hears of the asynchronous call at once, and rank 0 sends every
            # host to the engine then: nobody waits out the board's patience (1 s)
            assert took < 0.5, f"rank {rank} m.{k} took {took:.2f} s"
    assert sum(o[3] for o in results[0]) > 0, "no plain blocking allreduce went through the board"


@pytest.mark.timeout(90)
def test_a_rank_later_than_the_boards_patience_falls_back(fallbacks):
    groups, results = fallbacks("late")
    n = len(results)
    for rank, outs in enumerate(results):
        for k, (first, board, took, second) in enumerate(outs):
            late, delay = LATE[k]
            what = f"rank {rank}, rank {late} late"
            _same_bits(first, _expected([_x(k, r) for r in range(n)], "Sum", groups=groups),
                       what)
            _same_bits(second, _expected([_x(k + 10, r) for r in range(n)], "Min",
                                         groups=groups), what)
            assert board == 0, f"{what}: the late call was counted on the board"
            if rank != late:    # the late rank falls back at once: the others gave up
                assert took < delay + 0.5, f"{what}: took {took:.2f} s"


@pytest.mark.timeout(90)
def test_a_joined_rank_contributes_zeros_and_the_board_serves_again(fallbacks):
    groups, results = fallbacks("join")
    n = len(results)
    zeros = np.zeros(3)
    for rank, phases in enumerate(results):
        for k, (outs, deltas, last, after, after_board, why) in enumerate(phases):
            joiner = JOINERS[k]
            what = f"rank {rank}, rank {joiner} joined"
            assert last == results[0][k][2] and last != joiner, (what, last, results[0][k][2])
            assert len(outs) == (0 if rank == joiner else JOIN_STEPS), what
            for i, got in enumerate(outs):
                inputs = [zeros if r == joiner else _x(20 * k + i, r) for r in range(n)]
                _same_bits(got, _expected(inputs, "Sum" if i % 2 == 0 else "Average",
                                          groups=groups), f"{what}: j.{k}.{i}")
            assert deltas == [0] * len(outs), f"{what}: counted on the board: {deltas}"
            for i, got in enumerate(after):
                _same_bits(got, _expected([_x(100 + 10 * k + i, r) for r in range(n)], "Sum",
                                          groups=groups), f"{what}: after.{k}.{i}")
            # once every rank has joined, the boards serve again; the first call after may
            # still go to the engine: a worker that heard the join's end first can post while
            # its leader still waits for the join, which then sends the post to the engine
            assert after_board >= len(after) - 1, \
                (what, after_board, {r: p[k][5] for r, p in enumerate(results)})


@pytest.mark.timeout(90)
def test_process_set_allreduces_go_through_the_engine(fallbacks):
    groups, results = fallbacks("sets")
    n = len(results)
    for rank, outs in enumerate(results):
        for i, (a, b, sets_board, g, g_board) in enumerate(outs):
            what = f"rank {rank} step {i}"
            if rank in SET_A:
                _same_bits(a, _expected([_x(i, r) for r in SET_A], "Sum"), f"{what} set A")
            if rank in SET_B:
                _same_bits(b, _expected([_x(i, r) for r in SET_B], "Max"), f"{what} set B")
            assert sets_board == 0, f"{what}: a process set's allreduce counted on the board"
            _same_bits(g, _expected([_x(i, r) for r in range(n)], "Sum", groups=groups),
                       f"{what} global")
            assert g_board == results[0][i][4] and g_board in (0, 1), (what, g_board)
