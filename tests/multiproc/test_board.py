"""The board (hora.core.engine.board): blocking small allreduces of a one-host job, settled in
shared memory, on real ranks.

* It gives what NumPy gives reducing the gathered inputs in rank order with Horovod's
  scaling, the same bits on every rank, and up to 8 KiB the engine's bits (the same job with
  ``HORA_SHM_BOARD=0``); the metrics count exactly the calls it settled (blocking, global
  set, at most its capacity; at and past that limit, in-place, grouped, striped).
* A joined rank adds zeros; nothing stays in /dev/shm; barriers wait for the last rank.
* ``hora.torch.allreduce_`` of a small CPU tensor goes through it too.

A loop's repeated call (its lane) is test_board_lanes.py's; falling back to the engine
test_board_fallback.py's; a rank that dies or stops in a call test_board_failures.py's.
Expected values are computed here, from the inputs each rank returns (board_oracle.py).
The correctness calls, the one-number sums and the joined ranks share one job per N
(``jobs``), the board on and off.
"""

import functools
import importlib.util
import os
import time

import numpy as np
import pytest

import hora
from hora.core.engine.small import SMALL_ALLREDUCE
from tests.helpers import run_ranks, run_sections, section
from tests.multiproc.board_oracle import board_count as _board_count
from tests.multiproc.board_oracle import call as _call
from tests.multiproc.board_oracle import case_input as _input
from tests.multiproc.board_oracle import close as _close
from tests.multiproc.board_oracle import expected as _expected
from tests.multiproc.board_oracle import hora_files as _hora_files
from tests.multiproc.board_oracle import nbytes as _nbytes
from tests.multiproc.board_oracle import same_bits as _same_bits
from tests.multiproc.board_oracle import F32, OFF, STRIPE_BYTES, capacity as _capacity, step_input as _x

pytestmark = pytest.mark.timeout(60)


# -- 1. correctness: dtypes, ops, scaling, shapes, in place, the size limit -----------------
def _cases(n):
    """(tag, api, dtype, shapes, op, prescale, postscale) of every call, for ``n`` ranks."""
    return FIXED + _limits(_capacity(n) // 4) + _stripes()


FIXED = [
    ("f32.sum.1", "allreduce", "float32", [(1,)], "Sum", 1.0, 1.0),
    ("f32.avg.3x4", "allreduce", "float32", [(3, 4)], "Average", 1.0, 1.0),
    ("f64.avg.scaled", "allreduce", "float64", [(3, 4)], "Average", 0.5, 3.0),
    ("f16.sum.scaled", "allreduce", "float16", [(17,)], "Sum", 0.25, 2.0),
    ("f16.avg.inplace", "allreduce_", "float16", [(3, 4)], "Average", 1.0, 1.0),
    ("f32.min", "allreduce", "float32", [(5,)], "Min", 1.0, 1.0),
    ("f64.max.inplace", "allreduce_", "float64", [(5,)], "Max", 1.0, 1.0),
    ("f64.prod", "allreduce", "float64", [(6,)], "Product", 1.0, 1.0),
    ("f32.prod.scaled", "allreduce_", "float32", [(2, 3)], "Product", 1.5, 0.75),
    ("i32.sum", "allreduce", "int32", [(3, 4)], "Sum", 1.0, 1.0),
    ("i32.avg.scaled", "allreduce_", "int32", [(7,)], "Average", 3.0, 0.5),
    ("i64.prod", "allreduce", "int64", [(4,)], "Product", 1.0, 1.0),
    ("i64.min", "allreduce", "int64", [(4,)], "Min", 1.0, 1.0),
    ("i64.max.inplace", "allreduce_", "int64", [(4,)], "Max", 1.0, 1.0),
    ("i64.avg", "allreduce", "int64", [(5,)], "Average", 1.0, 1.0),
    ("bool.sum", "allreduce", "bool", [(9,)], "Sum", 1.0, 1.0),
    ("bool.max", "allreduce", "bool", [(9,)], "Max", 1.0, 1.0),
    ("bool.min.inplace", "allreduce_", "bool", [(9,)], "Min", 1.0, 1.0),
    ("bool.prod", "allreduce", "bool", [(9,)], "Product", 1.0, 1.0),
    ("f64.0d", "allreduce", "float64", [()], "Sum", 1.0, 1.0),
    # one float32 or float64 number, Sum or Average, no prescale: Python floats (_scalar);
    # the others, the numpy calls
    ("f32.avg.1", "allreduce", "float32", [(1,)], "Average", 1.0, 1.0),
    ("f32.sum.1.post.inplace", "allreduce_", "float32", [(1,)], "Sum", 1.0, 0.3),
    ("f64.avg.1.post", "allreduce", "float64", [(1,)], "Average", 1.0, 3.0),
    ("f64.sum.1x1.inplace", "allreduce_", "float64", [(1, 1)], "Sum", 1.0, 1.0),
    ("f32.avg.0d", "allreduce", "float32", [()], "Average", 1.0, 1.0),
    ("f32.sum.1.grouped", "grouped", "float32", [(1,)], "Sum", 1.0, 1.0),
    ("f32.sum.1.pre", "allreduce", "float32", [(1,)], "Sum", 2.5, 1.0),
    ("f32.max.1", "allreduce", "float32", [(1,)], "Max", 1.0, 1.0),
    ("f64.prod.1", "allreduce_", "float64", [(1,)], "Product", 1.0, 1.0),
    ("f16.avg.1", "allreduce", "float16", [(1,)], "Average", 1.0, 1.0),
    ("i64.sum.1", "allreduce", "int64", [(1,)], "Sum", 1.0, 1.0),
    ("f32.empty", "allreduce", "float32", [(0,)], "Sum", 1.0, 1.0),
    ("f32.2000", "allreduce", "float32", [(2000,)], "Sum", 0.5, 1.0),         # 8000 B
    ("f32.2048.inplace", "allreduce_", "float32", [(2048,)], "Average", 1.0, 1.0),  # 8 KiB
    ("f32.2049", "allreduce", "float32", [(2049,)], "Sum", 1.0, 1.0),        # 8 KiB + 4
    ("f32.transposed.inplace", "allreduce_T", "float32", [(4, 3)], "Sum", 1.0, 1.0),
    ("f64.strided", "allreduce_strided", "float64", [(10,)], "Sum", 1.0, 1.0),
    ("grouped.small", "grouped", "float32", [(3,), (2, 2)], "Sum", 2.0, 1.0),
    ("grouped.small.inplace", "grouped_", "float64", [(5,), (1,), (2, 3)], "Average", 1.0,
     1.0),
    ("grouped.8k", "grouped", "float32", [(1000,), (1048,)], "Min", 1.0, 1.0),   # 8 KiB
    ("grouped.8k+", "grouped", "float32", [(1500,), (600,)], "Sum", 1.0, 1.0),   # 8400 B
]


def _limits(f32):
    """Calls at the board's limit, ``f32`` float32 elements, and just past it."""
    return [
        ("f32.under", "allreduce", "float32", [(f32 - 48,)], "Sum", 0.5, 1.0),
        ("f32.limit.inplace", "allreduce_", "float32", [(f32,)], "Average", 1.0, 1.0),
        ("f64.limit", "allreduce", "float64", [(f32 // 2,)], "Max", 1.0, 1.0),
        ("f32.over", "allreduce", "float32", [(f32 + 1,)], "Sum", 1.0, 1.0),      # + 4 B
        ("i32.over.inplace", "allreduce_", "int32", [(f32 + 1,)], "Max", 1.0, 1.0),
        ("f64.over", "allreduce", "float64", [(f32 // 2 + 1,)], "Average", 2.0, 1.0),  # + 8 B
        ("grouped.limit", "grouped", "float32", [(1000,), (f32 - 1000,)], "Min", 1.0, 1.0),
        ("grouped.over", "grouped", "float32", [(f32 - 600,), (604,)], "Sum", 1.0, 1.0),
        ("f32.sum.again", "allreduce", "float32", [(1,)], "Sum", 1.0, 1.0),
    ]


def _stripes():
    """Calls around the size from which every rank reduces a stripe of the result (uneven
    stripes: element counts that do not divide among the ranks)."""
    if STRIPE_BYTES is None:
        return []
    e = STRIPE_BYTES // 4
    return [
        ("stripe.under", "allreduce", "float32", [(e - 1,)], "Sum", 1.0, 1.0),
        ("stripe.at", "allreduce", "float32", [(e,)], "Sum", 1.0, 1.0),
        ("stripe.odd.avg", "allreduce_", "float32", [(e + 37,)], "Average", 0.5, 3.0),
        ("stripe.f16", "allreduce", "float16", [(2 * e + 5,)], "Sum", 0.25, 2.0),
        ("stripe.f64.prod", "allreduce", "float64", [(e // 2 + 3,)], "Product", 1.0, 1.0),
        ("stripe.i32.avg", "allreduce_", "int32", [(e + 1,)], "Average", 3.0, 1.0),
        ("stripe.i64.min", "allreduce", "int64", [(e // 2 + 1,)], "Min", 1.0, 1.0),
        ("stripe.bool.max", "allreduce", "bool", [(4 * e + 11,)], "Max", 1.0, 1.0),
        ("stripe.grouped", "grouped", "float32", [(e // 2, 2), (5,)], "Max", 1.0, 1.0),
        ("stripe.grouped_", "grouped_", "float64", [(e // 4,), (e // 4 + 9,)], "Average", 1.0,
         1.0),
        ("stripe.small.after", "allreduce", "float32", [(3,)], "Sum", 1.0, 1.0),
    ]




def _correctness_worker():
    rank = hora.rank()
    out = []
    for i, (tag, api, dtype, shapes, op_name, pre, post) in enumerate(_cases(hora.size())):
        op = getattr(hora, op_name)
        xs = [_input(i, dtype, s, op_name, rank) for s in shapes]
        kept = [x.copy() for x in xs]
        kw = dict(op=op, name=tag, prescale_factor=pre, postscale_factor=post)
        got, same = _call(api, xs, kw)
        out.append((kept, [np.array(g, copy=True) for g in got], same, _board_count()))
    return out, hora.metrics()["data_plane"]


def _eligible(n, dtype, shapes):
    return _nbytes(dtype, shapes) <= _capacity(n)


def _rank_ordered(dtype, shapes, on_board):
    """Whether the result is the reduction in rank order: on the board, and on the engine's
    small path (rank 0 reduces what came with the requests); a data plane reduces chunks in
    other orders, so float results differ in the last bits (with 3 ranks or more)."""
    return on_board or _nbytes(dtype, shapes) <= SMALL_ALLREDUCE


JOIN_STEPS = 8


def _sections():
    # the correctness calls first: their counts of board calls (and the metrics) start from
    # none; the one-number sums count their own; with the board on, then a joined rank 1 and
    # a joined rank 0 (each counting from its own start)
    parts = {"correctness": _correctness_worker, "scalars": _scalars_worker}
    if os.environ.get("HORA_SHM_BOARD") != "0":
        parts.update({f"join.{joiner}": functools.partial(_join_early, joiner, JOIN_STEPS)
                      for joiner in (1, 0)})
    return run_sections(parts)


# 2 and 3 ranks: 3 is the odd N, whose stripes do not divide evenly, and more ranks than a
# 2-CPU machine has CPUs; 4 ranks took no path of their own (the board has no branch on N
# past 1, and its capacity, _cases(n), only moves the limits)
@pytest.fixture(scope="module", params=[2, 3])
def jobs(request):
    """One job with the board on and one with it off, on ``n`` ranks, of the correctness
    calls, the one-number sums and (the board on) the joined ranks."""
    n = request.param
    return n, run_ranks(_sections, n, timeout_s=60), run_ranks(_sections, n, timeout_s=60,
                                                               env=OFF)


def test_board_results_equal_the_engine_bit_for_bit_and_numpy(jobs):
    """Every call gives every rank the same bits, and the board's calls the bits of NumPy
    reducing the inputs in rank order.  Up to SMALL_ALLREDUCE (8 KiB) the engine reduces in
    rank order too (rank 0, from the requests): the same bits with the board on or off.  Above
    it the engine's data plane reduces in another order, so results match it to the last few
    places only (the board's docstring says as much)."""
    n, on, off = jobs
    on, off = section(on, "correctness"), section(off, "correctness")
    cases = _cases(n)
    eligible = [_eligible(n, c[2], c[3]) for c in cases]
    for rank in range(n):
        cases_on, planes_on = on[rank]
        cases_off, planes_off = off[rank]
        assert len(cases_on) == len(cases_off) == len(cases)
        for i, (tag, api, dtype, shapes, op, pre, post) in enumerate(cases):
            kept, got, same, count = cases_on[i]
            assert same, f"rank {rank} {tag}: the in-place result is not in the caller's array"
            assert cases_off[i][2], f"rank {rank} {tag} (board off): not in place"
            assert count == sum(eligible[:i + 1]), \
                (f"rank {rank} {tag}: {count} allreduces on the board after it, expected "
                 f"{sum(eligible[:i + 1])}")
            for j, shape in enumerate(shapes):
                inputs = [on[r][0][i][0][j] for r in range(n)]
                _same_bits(cases_off[i][0][j], inputs[rank], f"{tag} input")   # same job
                want = _expected(inputs, op, pre, post)
                got_off = cases_off[i][1][j]
                assert got[j].shape == shape
                what = f"rank {rank} {tag}[{j}]"
                _same_bits(got[j], on[0][0][i][1][j], f"{what} vs rank 0")
                _same_bits(got_off, off[0][0][i][1][j], f"{what} vs rank 0 (board off)")
                if _rank_ordered(dtype, shapes, eligible[i]):
                    _same_bits(got[j], want, f"{what} vs numpy")
                else:
                    _close(got[j], want, f"{what} vs numpy")
                if _rank_ordered(dtype, shapes, False):
                    _same_bits(got_off, want, f"{what} (board off) vs numpy")
                    _same_bits(got[j], got_off, f"{what} vs the engine")
                else:
                    _close(got_off, want, f"{what} (board off) vs numpy")
                    _close(got[j], got_off, f"{what} vs the engine")
        assert planes_on.get("board") == sum(eligible), planes_on
        assert "board" not in planes_off, planes_off
        # the engine ran the others; with the board off, all of them
        assert sum(planes_on.values()) - planes_on["board"] == len(cases) - sum(eligible)
        assert sum(planes_off.values()) == len(cases), planes_off


# -- one number: the board's sums in Python floats (Board.scalar) -----------------------------
_NUMBERS = {np.float32: [0.0, -0.0, 1.0, -1.5, 1 / 3, 1e-45, 1e-40, 1.1754944e-38, 3.4e38,
                         -3.4e38, 16777216.0, 1.0000001, 1e30, -7e-39],
            np.float64: [0.0, -0.0, 1.0, -1.5, 1 / 3, 5e-324, 1e-310, 2.2250738585072014e-308,
                         1.7e308, -1.7e308, 9007199254740992.0, 1.0000000000000002, 1e300,
                         -3e-310]}
_SCALAR_CALLS = 160


def _number(i, rank, dtype):
    """Call ``i``'s number on ``rank``: alternately random (normal, wide exponents) and
    picked from _NUMBERS (signed zeros, subnormals, the largest finite values, whose sums
    overflow); in some calls one rank brings an infinity or a NaN (one at most: two NaNs
    would leave which one comes out to the machine)."""
    rng = np.random.default_rng([7, i, rank])
    if i % 2:
        value = rng.choice(_NUMBERS[dtype])
    else:
        value = rng.standard_normal() * 10.0 ** rng.integers(-6, 7)
    if i % 5 == 4 and rank == i % hora.size():
        value = (np.inf, -np.inf, np.nan)[i // 5 % 3]
    return np.array([value], dtype=dtype)


def _scalar_case(i):
    """``(dtype, op, postscale, in place)`` of call ``i``."""
    return ((np.float32, np.float64)[i % 2], ("Sum", "Average")[i // 2 % 2],
            (1.0, 1.0, 0.1, 3.0)[i // 4 % 4], i % 3 == 0)


def _scalars_worker():
    from hora.core.engine.board import Board
    from hora.core.engine.lanes import Lane
    folded = [0]
    fold, lane_fold = Board._fold_scalar, Lane.fold_into

    def counted(self, *args):
        folded[0] += 1
        return fold(self, *args)

    def lane_counted(self, out):            # (a lane of one number: its view is set)
        folded[0] += self.view is not None
        return lane_fold(self, out)
    Board._fold_scalar, Lane.fold_into = counted, lane_counted
    rank = hora.rank()
    out = []
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(_SCALAR_CALLS):
            dtype, op, post, inplace = _scalar_case(i)
            x = _number(i, rank, dtype)
            kept = x.copy()
            kw = dict(op=getattr(hora, op), name=f"n.{i % 7}", postscale_factor=post)
            got = hora.allreduce_(x, **kw) if inplace else hora.allreduce(x, **kw)
            out.append((kept, np.array(got, copy=True)))
    return out, folded[0]


def test_one_number_sums_give_numpys_bits(jobs):
    """One float32 or float64 number summed or averaged, with postscales, among signed
    zeros, subnormals, overflowing sums, infinities and NaNs: the bits of NumPy reducing
    the gathered inputs in rank order, and of the engine (the board off), on every rank;
    and the board reduced them in Python floats."""
    n, on, off = jobs
    on, off = section(on, "scalars"), section(off, "scalars")
    for rank in range(n):
        assert on[rank][1] == _SCALAR_CALLS, f"rank {rank}: {on[rank][1]} calls in Python"
        assert off[rank][1] == 0
        for i in range(_SCALAR_CALLS):
            dtype, op, post, inplace = _scalar_case(i)
            inputs = [on[r][0][i][0] for r in range(n)]
            with np.errstate(over="ignore", invalid="ignore"):
                want = _expected(inputs, op, 1.0, post)
            what = f"rank {rank} call {i} ({np.dtype(dtype).name} {op} x{post}: {inputs})"
            _same_bits(on[rank][0][i][1], want, what)
            _same_bits(off[rank][0][i][1], want, what + " (board off)")


def _one_rank():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    a = hora.allreduce(x, op=hora.Average, name="a", prescale_factor=2.0,
                       postscale_factor=0.5)
    b = np.arange(4, dtype=np.int64) * 3
    hora.allreduce_(b, op=hora.Sum, name="b", postscale_factor=0.5)
    c = hora.allreduce(np.ones(F32 + 1, np.float32), name="c")    # too big to settle at once
    return a, b, c, hora.metrics()["data_plane"]


def test_a_one_rank_job_settles_small_blocking_allreduces_at_once():
    (a, b, c, planes), = run_ranks(_one_rank, 1, timeout_s=30)
    _same_bits(a, _expected([np.arange(6, dtype=np.float32).reshape(2, 3)], "Average", 2.0,
                            0.5), "a")
    _same_bits(b, _expected([np.arange(4, dtype=np.int64) * 3], "Sum", 1.0, 0.5), "b")
    _same_bits(c, np.ones(F32 + 1, np.float32), "c")
    assert planes.get("board") == 2, planes


def _rounds(rounds):
    out = []
    for k in range(rounds):
        hora.init()
        rank = hora.rank()
        a = hora.allreduce(np.arange(3.0) + rank, op=hora.Sum, name=f"round.{k}")
        # a signature longer than the board's slot has room for: the engine
        long = hora.allreduce(np.full(2, rank + 1.0), op=hora.Sum, name="L" * 300)
        # two dtypes: two collectives, each on the board
        g = hora.grouped_allreduce([np.arange(2, dtype=np.float32) + rank,
                                    np.arange(3, dtype=np.int64) * rank], op=hora.Max,
                                   name="mixed")
        out.append((a, long, g, hora.metrics()["data_plane"]))
        hora.shutdown()
    return out


def test_long_names_mixed_dtypes_and_a_second_init():
    n = 3
    results = run_ranks(_rounds, n, timeout_s=40, args=(2,), init=False)
    for rank, rounds in enumerate(results):
        for k, (a, long, g, planes) in enumerate(rounds):
            what = f"rank {rank} round {k}"
            _same_bits(a, _expected([np.arange(3.0) + r for r in range(n)], "Sum"), what)
            _same_bits(long, np.full(2, float(sum(range(1, n + 1)))), what)
            _same_bits(g[0], np.arange(2, dtype=np.float32) + n - 1, what)
            _same_bits(g[1], np.arange(3, dtype=np.int64) * (n - 1), what)
            assert planes.get("board") == 3 and sum(planes.values()) == 4, (what, planes)


# -- 2. join: joined ranks add zeros ------------------------------------------------------
def _join_early(joiner, steps):
    rank = hora.rank()
    hora.allreduce(np.ones(1), name="warm")
    outs = []
    if rank != joiner:
        for i in range(steps):
            op = hora.Sum if i % 2 == 0 else hora.Average
            outs.append(hora.allreduce(_x(i, rank), op=op, name=f"j.{i}"))
            if i == 0:
                time.sleep(0.05)        # the joiner has joined by now, on some steps
    last = hora.join()
    before = _board_count()
    after = [hora.allreduce(_x(50 + i, rank), op=hora.Sum, name=f"after.{i}")
             for i in range(5)]
    return outs, last, after, before, _board_count()


@pytest.mark.parametrize("joiner", [1, 0])
def test_a_joined_rank_contributes_zeros(jobs, joiner):
    """Horovod's join: a joined rank adds zeros to the others' allreduces, and an average
    still divides by every rank (as the engine does, hora.core.engine.executor)."""
    steps = JOIN_STEPS
    n, on, _ = jobs
    results = section(on, f"join.{joiner}")
    zeros = np.zeros(3)
    for rank, (outs, last, after, before, end) in enumerate(results):
        # the last rank to join: the same on every rank, one of those that did not join
        # early (which of them depends on timing)
        assert last == results[0][1] and last != joiner, (rank, last, results[0][1])
        if rank == joiner:
            assert outs == []
        else:
            assert len(outs) == steps
        for i, got in enumerate(outs):
            inputs = [zeros if r == joiner else _x(i, r) for r in range(n)]
            _same_bits(got, _expected(inputs, "Sum" if i % 2 == 0 else "Average"),
                       f"rank {rank} j.{i}")
        for i, got in enumerate(after):
            _same_bits(got, _expected([_x(50 + i, r) for r in range(n)], "Sum"),
                       f"rank {rank} after.{i}")
        # once every rank has joined, the board serves again
        assert end - before == len(after), (rank, before, end)


# -- 3. /dev/shm: the board's segment is unlinked once mapped ------------------------------
def _mapped_segments():
    with open("/proc/self/maps") as f:
        return sorted({line.split(None, 5)[5].strip() for line in f
                       if "/dev/shm/hora-" in line})


def _look_at_segments():
    hora.allreduce(np.ones(2), op=hora.Sum, name="x")
    pids = hora.allgather_object(os.getpid())
    return _mapped_segments(), _hora_files(set(pids)), pids, _board_count()


@pytest.mark.parametrize("env,board", [(None, True), (OFF, False), ({"HORA_BACKEND": "tcp"},
                                                                       False)])
def test_the_board_segment_is_mapped_unlinked_and_gone_after_the_job(env, board):
    results = run_ranks(_look_at_segments, 3, timeout_s=30, env=env)
    pids = set(results[0][2])
    for rank, (mapped, files, _, count) in enumerate(results):
        boards = [m for m in mapped if m.endswith("-board (deleted)")]
        if board:
            assert len(boards) == 1 and boards[0].startswith(f"/dev/shm/hora-{results[0][2][0]}-")
            assert count == 1
        else:
            assert boards == [] and count == 0, (mapped, count)
        assert not [m for m in mapped if "board" in m and not m.endswith("(deleted)")]
        assert files == [], f"rank {rank}: segments in /dev/shm: {files}"
    assert _hora_files(pids) == []


# -- 4. hora.torch --------------------------------------------------------------------------
def _torch_worker():
    import torch
    import hora.torch as hvd
    rank = hvd.rank()
    ins, outs, same = [], [], []
    for i, dtype in enumerate([torch.float32, torch.float64, torch.int64, torch.float16,
                               torch.bfloat16]):
        t = (torch.arange(6, dtype=torch.float64) * (rank + 1) + i).to(dtype)
        ins.append(t.clone().float().numpy() if dtype == torch.bfloat16 else t.clone().numpy())
        r = hvd.allreduce_(t, op=hvd.Sum, name=f"t.{i}")
        same.append(r is t)
        outs.append(t.float().numpy() if dtype == torch.bfloat16 else t.numpy())
    avg = hvd.allreduce(torch.tensor([1.0, 2.0, 4.0]) * (rank + 1), name="avg")
    big = torch.ones(F32 + 1, dtype=torch.float32)                 # too big: the engine
    hvd.allreduce_(big, op=hvd.Sum, name="big")
    return ins, outs, same, avg.numpy(), big.numpy(), _board_count()


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_torch_allreduce_in_place_of_a_small_cpu_tensor_goes_through_the_board():
    results = run_ranks(_torch_worker, 2, timeout_s=40)
    for rank, (ins, outs, same, avg, big, board) in enumerate(results):
        assert all(same), same
        for i, got in enumerate(outs):
            # small integers: every sum is exact, in bfloat16 too (staged through float32)
            _same_bits(got, _expected([results[r][0][i] for r in range(2)], "Sum"),
                       f"rank {rank} t.{i}")
        _same_bits(avg, np.array([1.5, 3.0, 6.0], np.float32), f"rank {rank} avg")
        _same_bits(big, np.full(F32 + 1, 2.0, np.float32), f"rank {rank} big")
        assert board == 6, f"rank {rank}: {board} allreduces on the board, expected 6"


# -- barriers ------------------------------------------------------------------------------
def _barriers(late_rank, delay):
    """Every rank stamps the time it leaves each barrier; ``late_rank`` comes ``delay`` s
    late to the second one.  Then a barrier and an allreduce under one name: a mismatch."""
    rank = hora.rank()
    hora.barrier()
    if rank == late_rank:
        time.sleep(delay)
    arrived = time.time()
    hora.barrier()
    left = time.time()
    for _ in range(50):
        hora.barrier()
    counts = dict(hora.metrics()["collectives"])
    board = _board_count()
    try:
        if rank == 0:
            hora.barrier(name="clash")
        else:
            hora.allreduce(np.ones(2), name="clash")
        clash = None
    except hora.HoraError as e:
        clash = type(e).__name__
    return arrived, left, counts, board, clash


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n,late_rank", [(2, 1), (3, 0)])
def test_barriers_settle_on_the_board_and_wait_for_the_last_rank(n, late_rank):
    results = run_ranks(_barriers, n, timeout_s=40, args=(late_rank, 0.3))
    late_arrival = results[late_rank][0]
    for rank, (arrived, left, counts, board, clash) in enumerate(results):
        # nobody leaves the barrier before the late rank came to it (one host: one clock)
        assert left >= late_arrival, (rank, left, late_arrival)
        assert counts.get("barrier") == 52, (rank, counts)
        assert board == 0, "barriers are not allreduces: the board's allreduce count stays 0"
        assert clash == "CollectiveMismatchError", (rank, clash)
