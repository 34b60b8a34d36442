"""The board across hosts (hora.core.engine.board): blocking small allreduces and barriers of
a job on several hosts, on real ranks on two "hosts" of this machine.

``hora.runner.run(..., hosts="localhost:2,127.0.0.1:2")`` places ranks on two host names that
are both this machine: each rank's HORA_HOSTNAME says which, so the topology sees 2 hosts of
2 ranks (the hierarchical data plane: real shared memory inside each host, real TCP between
them).  Each host has a board of its own; its lowest rank leads it; global rank 0 leads the
first host.  A blocking allreduce of fewer than ``STRIPE_BYTES`` (64 KiB) on the global set,
and a blocking barrier, settle on the boards: the workers post, each leader reduces its
host's inputs in rank order and sends the partial to rank 0, which adds the partials in host
order, scales, and answers.

* The result is that reduction, bit for bit, on every rank; the metrics count exactly those
  calls under ``data_plane["board"]``, once per call on every rank.  Larger, asynchronous
  and process-set allreduces go through the engine (not counted there).
* Whenever the boards cannot settle a call for certain (a rank's call is asynchronous, late,
  disagrees, or a rank has joined) every rank falls back to the engine: the values are right,
  a mismatch raises the engine's error on every rank, nothing hangs.
* A dead rank (a worker, the second host's leader, rank 0) fails the survivors' board calls
  within seconds, naming it; nothing stays in /dev/shm.
* ``HORA_SHM_BOARD=0``: no board, the engine's results.
* Hosts of one rank each (``localhost:1,127.0.0.1:1``), or of different sizes
  (``localhost:1,127.0.0.1:3``): the TCP ring is the data plane, and each host has a board all
  the same (a host of one rank, a board of one), with the same results, errors and failures.

Expected values are computed here, from the inputs each rank returns.
"""
import importlib.util
import os
import signal
import threading
import time

import numpy as np
import pytest

import hora
import hora.core.engine.board as _board
from hora.core.engine.board_rules import PATIENCE_S
from tests.helpers import RawJob, run_sections
from tests.multiproc.board_oracle import board_count as _board_count
from tests.multiproc.board_oracle import call as _call
from tests.multiproc.board_oracle import case_input as _input
from tests.multiproc.board_oracle import close as _close
from tests.multiproc.board_oracle import expected as _expected
from tests.multiproc.board_oracle import fallbacks as _fallbacks
from tests.multiproc.board_oracle import fallbacks_since as _fallbacks_since
from tests.multiproc.board_oracle import hora_files as _hora_files
from tests.multiproc.board_oracle import nbytes as _nbytes
from tests.multiproc.board_oracle import same_bits as _same_bits

pytestmark = pytest.mark.timeout(60)

HOSTS = "localhost:2,127.0.0.1:2"           # 2 hosts of 2 ranks: 0 1 | 2 3
HOSTS_3 = "localhost:3,127.0.0.1:3"         # 2 hosts of 3 ranks: 0 1 2 | 3 4 5
THREE_HOSTS = "localhost:2,127.0.0.1:2,127.0.0.2:2"     # 3 hosts of 2 ranks: 0 1 | 2 3 | 4 5
# hosts of one rank each, or of different sizes: the TCP ring is the data plane, and each
# host has a board all the same (a host of one rank: a board of one)
TWO_ONES = "localhost:1,127.0.0.1:1"                                # 0 | 1
FOUR_ONES = "localhost:1,127.0.0.1:1,127.0.0.2:1,127.0.0.3:1"      # 0 | 1 | 2 | 3
TWO_ONE = "localhost:2,127.0.0.1:1"                                 # 0 1 | 2
ONE_THREE = "localhost:1,127.0.0.1:3"                               # 0 | 1 2 3
AUTO = {"HORA_BACKEND": "auto"}
OFF = {"HORA_BACKEND": "auto", "HORA_SHM_BOARD": "0"}

STRIPE_BYTES = _board.STRIPE_BYTES          # from this size on: the engine, across hosts
E32 = STRIPE_BYTES // 4                     # float32 elements of 64 KiB


# -- jobs on two hosts ------------------------------------------------------------------------
def _slots(hosts):
    """``"a:2,b:2"`` -> ``[("a", 2), ("b", 2)]``."""
    out = []
    for entry in hosts.split(","):
        name, count = entry.rsplit(":", 1)
        out.append((name, int(count)))
    return out


def _np(hosts):
    return sum(c for _, c in _slots(hosts))


def _in_job(fn, args):
    hora.init()
    try:
        return fn(*args)
    finally:
        hora.shutdown()


def _run(fn, hosts=HOSTS, args=(), env=None, timeout_s=45):
    """``fn(*args)`` on every rank of a job on ``hosts`` (between hora.init() and shutdown());
    the results by rank."""
    from hora.runner import run
    return run(_in_job, args=(fn, args), np=_np(hosts), hosts=hosts,
               env=dict(AUTO, **(env or {})), timeout_s=timeout_s)


def _where():
    """This rank's place, as the job sees it."""
    from hora.core import state
    return dict(rank=hora.rank(), size=hora.size(), local_rank=hora.local_rank(),
                local_size=hora.local_size(), cross_rank=hora.cross_rank(),
                cross_size=hora.cross_size(), host=os.environ.get("HORA_HOSTNAME"),
                plane=type(state.engine()._plane).__name__)


def _plane(hosts):
    """The data plane a job on ``hosts`` has: the hierarchical one (hosts of the same number
    of ranks, more than one), else the TCP ring (no plane object)."""
    counts = {c for _, c in _slots(hosts)}
    return "Hierarchical" if len(counts) == 1 and counts != {1} else "NoneType"


def _host_groups(wheres, hosts=HOSTS):
    """The ranks of each host, hosts in the order of the -H list, ranks in rank order; checks
    that the job is the one on several hosts the tests mean."""
    slots = _slots(hosts)
    n = _np(hosts)
    assert [w["rank"] for w in wheres] == list(range(n)), wheres
    groups, first = {}, []
    for w in wheres:
        if w["host"] not in groups:
            first.append(w["host"])
            groups[w["host"]] = []
        groups[w["host"]].append(w["rank"])
    assert first == [name for name, _ in slots], (first, slots)
    for w in wheres:
        assert w["plane"] == _plane(hosts), f"rank {w['rank']}: data plane {w['plane']}"
        assert w["size"] == n
        assert w["local_size"] == len(groups[w["host"]])
        assert w["local_rank"] == groups[w["host"]].index(w["rank"])
        # (Horovod's cross ranks: among the hosts that have a rank of this local rank)
        peers = [h for h in first if len(groups[h]) > w["local_rank"]]
        assert w["cross_size"] == len(peers) and w["cross_rank"] == peers.index(w["host"])
    return [groups[h] for h in first]


def _x(i, rank, n=3):
    """Integer-valued floats: any order of their sums gives the same bits."""
    return np.arange(n, dtype=np.float64) + 10.0 * rank + i


# -- 1. correctness: dtypes, ops, scaling, shapes, in place, grouped, the 64 KiB limit -------
CASES = [
    # (tag, api, dtype, shapes, op, prescale, postscale)
    ("f32.sum.1", "allreduce", "float32", [(1,)], "Sum", 1.0, 1.0),
    ("f32.avg.3x4", "allreduce", "float32", [(3, 4)], "Average", 1.0, 1.0),
    ("f32.min", "allreduce", "float32", [(5,)], "Min", 1.0, 1.0),
    ("f32.max.scaled.inplace", "allreduce_", "float32", [(5,)], "Max", 2.0, 0.5),
    ("f32.prod.scaled.inplace", "allreduce_", "float32", [(2, 3)], "Product", 1.5, 0.75),
    ("f32.avg.postscaled", "allreduce", "float32", [(7,)], "Average", 1.0, 3.0),
    ("f64.sum", "allreduce", "float64", [(9,)], "Sum", 1.0, 1.0),
    ("f64.avg.scaled", "allreduce", "float64", [(3, 4)], "Average", 0.5, 3.0),
    ("f64.min.prescaled", "allreduce", "float64", [(4,)], "Min", 1.5, 1.0),
    ("f64.max.inplace", "allreduce_", "float64", [(5,)], "Max", 1.0, 1.0),
    ("f64.prod", "allreduce", "float64", [(6,)], "Product", 1.0, 1.0),
    ("f16.sum.scaled", "allreduce", "float16", [(17,)], "Sum", 0.25, 2.0),
    ("f16.avg.inplace", "allreduce_", "float16", [(3, 4)], "Average", 1.0, 1.0),
    ("f16.min", "allreduce", "float16", [(6,)], "Min", 1.0, 1.0),
    ("f16.max.scaled", "allreduce", "float16", [(6,)], "Max", 0.5, 1.0),
    ("f16.prod", "allreduce", "float16", [(5,)], "Product", 1.0, 1.0),
    ("i32.sum", "allreduce", "int32", [(3, 4)], "Sum", 1.0, 1.0),
    ("i32.avg.scaled.inplace", "allreduce_", "int32", [(7,)], "Average", 3.0, 0.5),
    ("i32.min.prescaled", "allreduce", "int32", [(6,)], "Min", 0.7, 1.0),
    ("i32.max", "allreduce", "int32", [(6,)], "Max", 1.0, 1.0),
    ("i32.prod", "allreduce", "int32", [(5,)], "Product", 1.0, 1.0),
    ("i64.sum.postscaled", "allreduce", "int64", [(5,)], "Sum", 1.0, 0.3),
    ("i64.avg", "allreduce", "int64", [(5,)], "Average", 1.0, 1.0),
    ("i64.min", "allreduce", "int64", [(4,)], "Min", 1.0, 1.0),
    ("i64.max.inplace", "allreduce_", "int64", [(4,)], "Max", 1.0, 1.0),
    ("i64.prod", "allreduce", "int64", [(4,)], "Product", 1.0, 1.0),
    ("f64.0d", "allreduce", "float64", [()], "Sum", 1.0, 1.0),
    ("f32.0d.avg", "allreduce", "float32", [()], "Average", 1.0, 1.0),
    ("i64.0d.max", "allreduce", "int64", [()], "Max", 1.0, 1.0),
    ("f32.empty", "allreduce", "float32", [(0,)], "Sum", 1.0, 1.0),
    ("i64.empty.2d", "allreduce", "int64", [(3, 0)], "Max", 1.0, 1.0),
    ("f32.transposed.inplace", "allreduce_T", "float32", [(4, 3)], "Sum", 1.0, 1.0),
    ("f64.strided", "allreduce_strided", "float64", [(10,)], "Sum", 1.0, 1.0),
    ("grouped.f32", "grouped", "float32", [(3,), (2, 2)], "Sum", 2.0, 1.0),
    ("grouped.f64.avg", "grouped", "float64", [(5,), (1,), (2, 3)], "Average", 1.0, 1.0),
    ("grouped.f16.max", "grouped", "float16", [(4,), (3,)], "Max", 1.0, 1.0),
    ("grouped.i64.prod", "grouped", "int64", [(3,), (4,)], "Product", 1.0, 1.0),
    # just below 64 KiB: still the boards
    ("f32.below", "allreduce", "float32", [(E32 - 1,)], "Sum", 0.5, 1.0),
    ("f32.below.avg.inplace", "allreduce_", "float32", [(E32 - 1,)], "Average", 1.0, 3.0),
    ("f64.below.prod", "allreduce", "float64", [(E32 // 2 - 1,)], "Product", 1.0, 1.0),
    ("f16.below", "allreduce", "float16", [(2 * E32 - 1,)], "Sum", 0.25, 2.0),
    ("i32.below.avg.inplace", "allreduce_", "int32", [(E32 - 1,)], "Average", 3.0, 1.0),
    ("i64.below.min", "allreduce", "int64", [(E32 // 2 - 1,)], "Min", 1.0, 1.0),
    ("grouped.below", "grouped", "float32", [(E32 // 2,), (E32 // 2 - 1,)], "Max", 1.0, 1.0),
    # 64 KiB and more: the engine
    ("f32.at", "allreduce", "float32", [(E32,)], "Sum", 1.0, 1.0),
    ("f32.above", "allreduce", "float32", [(E32 + 1,)], "Sum", 1.0, 1.0),
    ("grouped.at", "grouped", "float32", [(E32 // 2,), (E32 // 2,)], "Sum", 1.0, 1.0),
    ("f64.big.avg", "allreduce", "float64", [(E32,)], "Average", 0.5, 1.0),
    ("i32.big.max.inplace", "allreduce_", "int32", [(4 * E32 + 3,)], "Max", 1.0, 1.0),
    ("f32.small.after", "allreduce", "float32", [(3,)], "Sum", 1.0, 1.0),
]


ON_BOARD = [_nbytes(c[2], c[3]) < STRIPE_BYTES for c in CASES]


def _correctness_worker():
    rank = hora.rank()
    out = []
    for i, (tag, api, dtype, shapes, op_name, pre, post) in enumerate(CASES):
        op = getattr(hora, op_name)
        xs = [_input(i, dtype, s, op_name, rank) for s in shapes]
        kept = [x.copy() for x in xs]
        kw = dict(op=op, name=tag, prescale_factor=pre, postscale_factor=post)
        got, same = _call(api, xs, kw)
        out.append((kept, [np.array(g, copy=True) for g in got], same, _board_count()))
    return _where(), out, hora.metrics()["data_plane"]


def _check_job(results, hosts, board):
    """Every rank's results of a correctness job: the same bits everywhere; the boards' calls
    (``board``: the job had them on) the oracle's bits, counted once each; the engine's within
    float tolerance of the oracle (equal for integers)."""
    groups = _host_groups([r[0] for r in results], hosts)
    n = len(results)
    for rank, (_, cases, planes) in enumerate(results):
        assert len(cases) == len(CASES)
        for i, (tag, api, dtype, shapes, op, pre, post) in enumerate(CASES):
            kept, got, same, count = cases[i]
            what = f"rank {rank} {tag}" + ("" if board else " (board off)")
            assert same, f"{what}: the in-place result is not in the caller's array"
            if board:
                want_count = sum(ON_BOARD[:i + 1])
                assert count == want_count, \
                    f"{what}: {count} allreduces on the board after it, expected {want_count}"
            else:
                assert count == 0, f"{what}: {count} on the board"
            for j, shape in enumerate(shapes):
                inputs = [results[r][1][i][0][j] for r in range(n)]
                want = _expected(inputs, op, pre, post, groups)
                assert got[j].shape == shape, (what, got[j].shape, shape)
                _same_bits(got[j], results[0][1][i][1][j], f"{what}[{j}] vs rank 0")
                if board and ON_BOARD[i]:
                    _same_bits(got[j], want, f"{what}[{j}] vs the boards' reduction")
                else:
                    _close(got[j], want, f"{what}[{j}] vs numpy")
        if board:
            assert planes.get("board") == sum(ON_BOARD), planes
            engine = sum(planes.values()) - planes["board"]
            assert engine == len(CASES) - sum(ON_BOARD), planes
        else:
            assert "board" not in planes, planes
            assert sum(planes.values()) == len(CASES), planes


def test_results_on_two_hosts_of_two_bit_for_bit_and_with_the_board_off():
    """4 ranks on 2 hosts: every call gives every rank the same bits; below 64 KiB the bits of
    the per-host-then-across-hosts reduction, counted on the board; from 64 KiB on, and with
    HORA_SHM_BOARD=0, the engine's (within float tolerance, equal for integers)."""
    on = _run(_correctness_worker)
    _check_job(on, HOSTS, board=True)
    off = _run(_correctness_worker, env=OFF)
    _check_job(off, HOSTS, board=False)
    for rank in range(len(on)):
        for i, (tag, _, dtype, shapes, *_rest) in enumerate(CASES):
            for j in range(len(shapes)):
                _same_bits(on[rank][1][i][0][j], off[rank][1][i][0][j], f"{tag} input")
                if np.dtype(dtype).kind == "i":
                    _same_bits(on[rank][1][i][1][j], off[rank][1][i][1][j],
                               f"rank {rank} {tag}[{j}]: board vs engine")


@pytest.mark.timeout(90)
def test_results_on_two_hosts_of_three_bit_for_bit():
    """6 ranks, 3 on each host: each host reduces 3 inputs in rank order before the hosts'
    partials meet at rank 0."""
    _check_job(_run(_correctness_worker, hosts=HOSTS_3, timeout_s=70), HOSTS_3, board=True)


@pytest.mark.timeout(90)
def test_results_on_three_hosts_of_two_bit_for_bit():
    """6 ranks on 3 hosts (127.0.0.2 is this machine too): rank 0 adds two other leaders'
    partials, in host order."""
    _check_job(_run(_correctness_worker, hosts=THREE_HOSTS, timeout_s=70), THREE_HOSTS,
               board=True)


@pytest.mark.parametrize("hosts", [TWO_ONES, FOUR_ONES, TWO_ONE, ONE_THREE],
                         ids=["2x1", "4x1", "2+1", "1+3"])
def test_results_on_hosts_the_ring_serves_bit_for_bit_and_with_the_board_off(hosts):
    """One rank on each host, or hosts of different sizes (the TCP ring is the data plane):
    each host has a board all the same (a host of one rank leads a board of one, whose
    partial is its own prescaled input), so below 64 KiB the bits of the per-host-then-
    across-hosts reduction; from 64 KiB on, and with HORA_SHM_BOARD=0, the engine's."""
    _check_job(_run(_correctness_worker, hosts=hosts), hosts, board=True)
    _check_job(_run(_correctness_worker, hosts=hosts, env=OFF), hosts, board=False)


def _lanes_worker():
    from tests.multiproc.test_board import LANE_STEPS, _lane_loop
    return _where(), _lane_loop(LANE_STEPS)


@pytest.mark.parametrize("hosts", [HOSTS, TWO_ONE], ids=["2x2", "2+1"])
def test_a_repeated_call_keeps_its_lane_across_hosts(hosts):
    """test_board.py's loop of one name, now and then with another dtype, shape, layout, op,
    postscale, or as a copy, on two hosts: every result has the bits of the per-host-then-
    across-hosts reduction on every rank; the boards settled every call, and the lanes (host
    rounds, whose result every rank copies) every one but the array's neither flat nor
    contiguous."""
    from tests.multiproc.test_board import LANE_STEPS, _lane_case
    results = _run(_lanes_worker, hosts=hosts)
    groups = _host_groups([r[0] for r in results], hosts)
    general = sum(_lane_case(i)[0] == "T" for i in range(LANE_STEPS))
    n = len(results)
    for rank, (_, (calls, lanes, folds, board, stripes)) in enumerate(results):
        assert board == LANE_STEPS, (rank, board)
        assert (lanes, folds, stripes) == (LANE_STEPS - general, 0, 0), (rank, lanes, folds)
        for i, (tag, kept, got) in enumerate(calls):
            _, _, dtype, shape, op, post = _lane_case(i)
            with np.errstate(over="ignore"):
                want = _expected([results[r][1][0][i][1] for r in range(n)], op, 1.0, post,
                                 groups)
            _same_bits(got, want, f"rank {rank} call {i} ({tag})")


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


SCALE_ONLY = ("m.prescale", "m.postscale")


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


@pytest.mark.parametrize("hosts", [HOSTS, FOUR_ONES, ONE_THREE], ids=["2x2", "4x1", "1+3"])
def test_mismatched_calls_raise_the_engines_error_on_every_rank(hosts):
    """Shapes, dtypes, ops, kinds (an allgather, a barrier), sizes on either side of 64 KiB,
    scale factors: the engine's errors (or results) on every rank, by the same ranks
    disagreeing with the boards on and off; names that differ: the engine's stall, which it
    ends with an error on every rank (a deadlock: every rank waits for a name another did
    not submit) before HORA_STALL_SHUTDOWN_TIME_SECONDS would.  On 2 hosts of 2
    ranks, on 4 hosts of one (every rank leads a board of one), and on a host of one and a
    host of three."""
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
            if key in SCALE_ONLY:
                assert res[0] == ref[0], (rank, key, res, ref)
                if res[0] == "ok":
                    _same_bits(res[1], ref[1], f"rank {rank} {key} vs engine")
                else:
                    assert res[1] == ref[1], (rank, key, res, ref)
                continue
            assert ref[0] == "error" and ref[1] == "CollectiveMismatchError", (rank, key, ref)
            assert res[0] == "error", f"rank {rank} {key}: no error with the board: {res}"
            assert res[1] == ref[1], (rank, key, res, ref)
            assert repr(key) in res[2], (rank, key, res)
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


# -- 5. hora.torch ----------------------------------------------------------------------------
def _torch_worker():
    import torch
    import hora.torch as hvd
    rank = hvd.rank()
    rng = np.random.default_rng(rank)
    ins, outs, same, deltas = [], [], [], []
    for i, dtype in enumerate([torch.float32, torch.float64, torch.int32, torch.int64,
                               torch.float16]):
        t = torch.from_numpy(rng.integers(-20, 20, size=(3, 2))).to(dtype)
        ins.append(t.clone().numpy())
        before = _board_count()
        r = hvd.allreduce_(t, op=hvd.Sum, name=f"t.{i}")
        deltas.append(_board_count() - before)
        same.append(r is t)
        outs.append(t.numpy().copy())
    x = torch.from_numpy((rng.standard_normal(7) * 10).astype(np.float32))
    before = _board_count()
    avg = hvd.allreduce(x, name="avg")                          # Average, by default
    y = torch.from_numpy(rng.standard_normal(5) * 10)
    scaled = hvd.allreduce(y, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0,
                           name="scaled")
    deltas.append(_board_count() - before)
    big = torch.ones(E32 + 1, dtype=torch.float32)              # 64 KiB + 4: the engine
    before = _board_count()
    hvd.allreduce_(big, op=hvd.Sum, name="big")
    deltas.append(_board_count() - before)
    return (_where(), ins, outs, same, x.numpy(), avg.numpy(), y.numpy(), scaled.numpy(),
            big.numpy(), deltas)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
@pytest.mark.timeout(90)
def test_torch_allreduces_of_small_cpu_tensors_go_through_the_boards():
    results = _run(_torch_worker, timeout_s=80)
    groups = _host_groups([r[0] for r in results])
    n = len(results)
    for rank, (_, ins, outs, same, x, avg, y, scaled, big, deltas) in enumerate(results):
        assert all(same), same
        for i, got in enumerate(outs):
            _same_bits(got, _expected([results[r][1][i] for r in range(n)], "Sum",
                                      groups=groups), f"rank {rank} t.{i}")
        _same_bits(avg, _expected([results[r][4] for r in range(n)], "Average", groups=groups),
                   f"rank {rank} avg")
        _same_bits(scaled, _expected([results[r][6] for r in range(n)], "Sum", 0.5, 3.0,
                                     groups=groups), f"rank {rank} scaled")
        _same_bits(big, np.full(E32 + 1, float(n), np.float32), f"rank {rank} big")
        assert deltas == [1] * len(outs) + [2, 0], f"rank {rank}: counted on the board: {deltas}"


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
            def die_soon():
                time.sleep(0.3)
                os.kill(os.getpid(), signal.SIGKILL)
            with open(os.environ["DEATH_FILE"], "w") as f:
                f.write(repr(time.time() + 0.3))
            threading.Thread(target=die_soon, daemon=True).start()
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


@pytest.mark.parametrize("hosts,victim,how", [
    (HOSTS, 3, "kill"), (HOSTS, 1, "kill"), (HOSTS, 2, "kill"), (HOSTS, 0, "kill"),
    (HOSTS, 3, "posted"), (HOSTS, 2, "posted"),
    (FOUR_ONES, 3, "kill"), (FOUR_ONES, 0, "kill"), (FOUR_ONES, 2, "posted"),
    (ONE_THREE, 1, "kill"), (ONE_THREE, 3, "posted")],
    ids=["worker-of-host-1", "worker-of-host-0", "leader-of-host-1", "rank-0",
         "worker-of-host-1-posted", "leader-of-host-1-posted",
         "4x1-host-3", "4x1-rank-0", "4x1-host-2-posted",
         "1+3-leader-of-host-1", "1+3-worker-posted"])
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
