"""The board (hora.core.engine.board): blocking small allreduces of a one-host job, settled in
shared memory, on real ranks.

* It gives what NumPy gives reducing the gathered inputs in rank order with Horovod's
  scaling, the same bits on every rank, and up to 8 KiB the engine's bits (the same job with
  ``HORA_SHM_BOARD=0``); the metrics count exactly the calls it settled (blocking, global
  set, at most its capacity; at and past that limit, in-place, grouped, striped).
* Whenever it cannot settle a call (another rank's call is asynchronous, holds a collective
  in flight, is late, disagrees, or has joined) every rank falls back to the engine: the
  values are right, a mismatch raises the engine's error, nothing hangs.
* A dead rank fails the survivors' board calls within seconds, naming it; nothing stays in
  /dev/shm.
* ``hora.torch.allreduce_`` of a small CPU tensor goes through it too.

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
from hora.core.engine.small import SMALL_ALLREDUCE
from tests.helpers import die_in, run_ranks, until_one_dies
from tests.multiproc.board_oracle import board_count as _board_count
from tests.multiproc.board_oracle import call as _call
from tests.multiproc.board_oracle import case_input as _input
from tests.multiproc.board_oracle import close as _close
from tests.multiproc.board_oracle import expected as _expected
from tests.multiproc.board_oracle import hora_files as _hora_files
from tests.multiproc.board_oracle import nbytes as _nbytes
from tests.multiproc.board_oracle import same_bits as _same_bits

pytestmark = pytest.mark.timeout(60)

OFF = {"HORA_SHM_BOARD": "0"}

# The board's limits, read from it (they moved while it was written: 8 KiB, then more, a
# capacity that may depend on the job's size, stripes from some size on).
BOARD_BYTES = _board.BOARD_BYTES        # the largest allreduce the board takes
STRIPE_BYTES = getattr(_board, "STRIPE_BYTES", None)    # from here every rank reduces a part


def _capacity(n):
    """The largest input the board of an ``n``-rank job takes."""
    capacity = getattr(_board, "board_capacity", None)
    return capacity(n) if capacity is not None else BOARD_BYTES


F32 = BOARD_BYTES // 4                  # float32 elements of the largest board input


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


@pytest.mark.parametrize("n", [2, 3, 4])
def test_board_results_equal_the_engine_bit_for_bit_and_numpy(n):
    """Every call gives every rank the same bits, and the board's calls the bits of NumPy
    reducing the inputs in rank order.  Up to SMALL_ALLREDUCE (8 KiB) the engine reduces in
    rank order too (rank 0, from the requests): the same bits with the board on or off.  Above
    it the engine's data plane reduces in another order, so results match it to the last few
    places only (the board's docstring says as much)."""
    on = run_ranks(_correctness_worker, n, timeout_s=40)
    off = run_ranks(_correctness_worker, n, timeout_s=40, env=OFF)
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


@pytest.mark.parametrize("n", [2, 3])
def test_one_number_sums_give_numpys_bits(n):
    """One float32 or float64 number summed or averaged, with postscales, among signed
    zeros, subnormals, overflowing sums, infinities and NaNs: the bits of NumPy reducing
    the gathered inputs in rank order, and of the engine (the board off), on every rank;
    and the board reduced them in Python floats."""
    on = run_ranks(_scalars_worker, n, timeout_s=40)
    off = run_ranks(_scalars_worker, n, timeout_s=40, env=OFF)
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


# -- lanes: a call that a loop repeats (lanes.make_lane, BoardCalls.lane_call) -----------------
# (tag, api, dtype, shape, op, postscale) of the calls of _lane_loop, every one named "loop":
# the plain call again and again, and now and then the same name with something changed
LANE_BASE = ("base", "allreduce_", "float32", (4,), "Sum", 1.0)
LANE_CHANGES = [
    ("f64", "allreduce_", "float64", (4,), "Sum", 1.0),
    ("2d", "allreduce_", "float32", (2, 2), "Sum", 1.0),
    ("T", "allreduce_T", "float32", (2, 2), "Sum", 1.0),            # not contiguous
    ("strided", "allreduce_strided", "float32", (4,), "Sum", 1.0),  # 1-d, every other one
    ("avg", "allreduce_", "float32", (4,), "Average", 1.0),
    ("post", "allreduce_", "float32", (4,), "Sum", 0.5),
    ("copy", "allreduce", "float32", (4,), "Sum", 1.0),
    ("big-endian", "allreduce_", ">f4", (4,), "Sum", 1.0),
    ("one", "allreduce_", "float32", (1,), "Average", 1.0),         # in Python floats
    ("one.post", "allreduce", "float64", (), "Sum", 3.0),
    ("int", "allreduce_", "int32", (4,), "Max", 1.0),
    ("copy.2d", "allreduce", "float32", (2, 2), "Average", 1.0),   # the fold makes the result
    ("prod", "allreduce", "float64", (4,), "Product", 1.0),
    ("int.one", "allreduce", "int64", (1,), "Min", 1.0),
]
LANE_STEPS = 3 * 4 * len(LANE_CHANGES)
# the same from STRIPE_BYTES: striped lanes, whose own stripe is read from the caller's array
# (from 256 KiB) or staged too; an array not contiguous takes the general path
LANE_STRIPED_BASE = ("base", "allreduce_", "float32", (1 << 17,), "Sum", 1.0)    # 512 KiB
LANE_STRIPED_CHANGES = [
    ("staged", "allreduce_", "float32", (20000,), "Sum", 1.0),
    ("f64", "allreduce_", "float64", (1 << 16,), "Sum", 1.0),
    ("2d", "allreduce_", "float32", (256, 512), "Sum", 1.0),
    ("T", "allreduce_T", "float32", (256, 512), "Sum", 1.0),
    ("strided", "allreduce_strided", "float32", (1 << 17,), "Sum", 1.0),
    ("avg", "allreduce_", "float32", (1 << 17,), "Average", 1.0),
    ("post", "allreduce_", "float32", (1 << 17,), "Sum", 0.5),
    ("copy", "allreduce", "float32", (1 << 17,), "Sum", 1.0),
    ("big-endian", "allreduce_", ">f4", (1 << 17,), "Sum", 1.0),
    ("odd", "allreduce_", "float32", (65541,), "Sum", 1.0),     # stripes of unequal sizes
    ("int", "allreduce_", "int32", (1 << 17,), "Max", 1.0),
]
LANE_STRIPED_STEPS = 3 * 4 * len(LANE_STRIPED_CHANGES)


def _lane_case(i, striped=False):
    changes, base = ((LANE_STRIPED_CHANGES, LANE_STRIPED_BASE) if striped
                     else (LANE_CHANGES, LANE_BASE))
    return changes[i // 4 % len(changes)] if i % 4 == 3 else base


def _lane_input(i, rank, dtype, shape):
    size = int(np.prod(shape))
    return (np.arange(size) * 0.37 + 1.3 * rank + i).astype(dtype).reshape(shape)


def _lane_loop(steps, striped=False):
    """Every rank calls allreduce "loop" ``steps`` times (_lane_case); returns each call's
    (tag, input, result), how many calls the lanes took, how many of them they reduced in
    SHARED rounds (one host; a host round's result comes from its leaders), the board
    count, and how many striped rounds the lanes reduced."""
    from hora.core import state
    from hora.core.engine.board_calls import BoardCalls
    from hora.core.engine.lanes import Lane
    count = {"lanes": 0, "folds": 0, "stripes": 0}
    fold, stripe, call = Lane.fold_into, Lane.reduce_stripe, BoardCalls.lane_call

    def counted(self, out):
        count["folds"] += 1
        return fold(self, out)

    def striped_(self, a):
        count["stripes"] += 1
        return stripe(self, a)

    def taken(self, lane, a, inplace):
        got = call(self, lane, a, inplace)
        count["lanes"] += got is not None
        return got
    Lane.fold_into, Lane.reduce_stripe, BoardCalls.lane_call = counted, striped_, taken
    engine = state.engine()
    engine.lane_now = engine._calls.lane_call   # (bound when the engine was made: anew)
    rank = hora.rank()
    out = []
    for i in range(steps):
        tag, api, dtype, shape, op, post = _lane_case(i, striped)
        x = _lane_input(i, rank, dtype, shape)
        kept = x.copy()
        kw = dict(op=getattr(hora, op), name="loop", postscale_factor=post)
        if api == "allreduce_T":
            x = np.ascontiguousarray(x.T).T
            got = hora.allreduce_(x, **kw)
        elif api == "allreduce_strided":
            wide = np.zeros(2 * x.size, x.dtype)
            wide[::2] = x
            got = hora.allreduce_(wide[::2], **kw)
        else:
            got = getattr(hora, api)(x, **kw)
        out.append((tag, kept, np.array(got, copy=True)))
    return out, count["lanes"], count["folds"], _board_count(), count["stripes"]


@pytest.mark.parametrize("n", [2, 4])
def test_a_repeated_call_keeps_its_lane_until_the_call_changes(n):
    """One name called again and again, now and then with another dtype, shape, layout, op,
    postscale, or as a copy instead of in place: every result has NumPy's bits on every
    rank, and the board off's; the board settled every call, and the lanes every one but
    those of the array neither flat nor contiguous (the board's general path)."""
    on = run_ranks(_lane_loop, n, timeout_s=40, args=(LANE_STEPS,))
    off = run_ranks(_lane_loop, n, timeout_s=40, args=(LANE_STEPS,), env=OFF)
    general = sum(_lane_case(i)[0] == "T" for i in range(LANE_STEPS))
    for rank in range(n):
        _, lanes, folds, board, stripes = on[rank]
        assert board == LANE_STEPS, (rank, board)
        assert lanes == folds == LANE_STEPS - general, (rank, lanes, folds)
        assert stripes == 0 and off[rank][1] == 0, (rank, stripes, off[rank][1])
        _check_lane_calls(on, off, rank, False, True)


def _check_lane_calls(on, off, rank, striped, off_exact):
    """Every call of ``rank``'s lane loop (``on``; ``off``: the board off) has NumPy's bits
    of every rank's input; the board off's has them too, or, where not ``off_exact``, a
    float result within rounding of them."""
    n = len(on)
    for i, (tag, _, got) in enumerate(on[rank][0]):
        op, post = _lane_case(i, striped)[4:]
        what = f"rank {rank} call {i} ({tag})"
        with np.errstate(over="ignore"):
            want = _expected([on[r][0][i][1] for r in range(n)], op, 1.0, post)
        _same_bits(got, want, what)
        if off_exact or want.dtype.kind != "f":
            _same_bits(off[rank][0][i][2], want, what + " (board off)")
        else:
            np.testing.assert_allclose(off[rank][0][i][2], want, rtol=1e-6,
                                       err_msg=what + " (board off)")


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_repeated_striped_call_keeps_its_lane_until_the_call_changes(n):
    """The same loop from STRIPE_BYTES (512 KiB a call; 80 KB, staged whole; an odd count of
    elements): every result has NumPy's bits on every rank, and the board off's; the board
    settled every call, and striped lanes every one but those of the arrays not contiguous.
    (The engine's path, the board off, adds more than two inputs in another order: its
    results are NumPy's within rounding.)"""
    on = run_ranks(_lane_loop, n, timeout_s=40, args=(LANE_STRIPED_STEPS, True))
    off = run_ranks(_lane_loop, n, timeout_s=40, args=(LANE_STRIPED_STEPS, True), env=OFF)
    general = sum(_lane_case(i, True)[0] in ("T", "strided") for i in range(LANE_STRIPED_STEPS))
    for rank in range(n):
        _, lanes, folds, board, stripes = on[rank]
        assert board == LANE_STRIPED_STEPS, (rank, board)
        assert lanes == stripes == LANE_STRIPED_STEPS - general, (rank, lanes, stripes)
        assert folds == 0 and off[rank][1] == 0, (rank, folds, off[rank][1])
        _check_lane_calls(on, off, rank, True, n == 2)


def _lane_late_workers(steps, flag_path):
    """Rank 0 calls a lane at once; the other rank posts as soon as rank 0 says, through
    the word at ``flag_path``, that it waits on its lane (every other call), or after a busy
    wait of 400 µs, so that rank 0 waits for its post (BoardCalls._lane_wait, then the general
    wait); returns each call's (input, result) and, on rank 0, how many of its waits the
    lane's own wait settled and how many it left to the general one.  (A fixed 25 µs
    instead of the word missed the lane's 50 µs wait on a loaded machine.)"""
    import mmap

    from hora.core.engine.board_calls import BoardCalls
    count = {"settled": 0, "left": 0, "call": 0}
    with open(flag_path, "r+b") as f:
        word = np.frombuffer(mmap.mmap(f.fileno(), 8), dtype=np.int64)
    wait = BoardCalls._lane_wait

    def counted(self, lane, what):
        word[0] = count["call"] + 1             # (rank 0 waits on its lane for this call)
        got = wait(self, lane, what)
        count["settled" if got else "left"] += 1
        return got
    BoardCalls._lane_wait = counted
    rank = hora.rank()
    out = []
    for i in range(steps):
        count["call"] = i
        x = (np.arange(8) * 0.37 + 1.3 * rank + i).astype(np.float32)
        if rank:
            until = time.perf_counter() + (0.05 if i % 2 else 400e-6)
            while time.perf_counter() < until and not (i % 2 and word[0] > i):
                pass
        out.append((x, hora.allreduce(x, op=hora.Sum, name="late")))
    return out, count["settled"], count["left"]


def test_rank_0_waits_on_its_lane_for_late_posts(tmp_path):
    """Rank 0 comes first to a lane's call: its short wait settles the posts that come
    within BOARD_STEP_S, the general wait those that come later, and every result has
    NumPy's bits of the inputs in rank order."""
    steps = 200
    flag = tmp_path / "flag"
    flag.write_bytes(bytes(8))
    got = run_ranks(_lane_late_workers, 2, timeout_s=40, args=(steps, str(flag)))
    _, settled, left = got[0]
    assert settled >= steps // 10 and left >= steps // 10, (settled, left)
    for i in range(steps):
        want = _expected([got[r][0][i][0] for r in range(2)], "Sum")
        for r in range(2):
            _same_bits(got[r][0][i][1], want, f"rank {r} call {i}")


def _lane_after_engine_work(steps):
    """Collectives through the engine (an asynchronous allreduce, an allgather), then a loop
    of one blocking allreduce: the loop's results, and on rank 0 how many of its calls found
    the engine idle and looked at the posts themselves (answered them at once, or waited on
    the lane: ``BoardCalls._lane_wait``)."""
    from hora.core import stats
    from hora.core.engine.board_calls import BoardCalls
    rank = hora.rank()
    wait = BoardCalls._lane_wait
    count = {"waits": 0}

    def counted(self, *args):
        count["waits"] += 1
        return wait(self, *args)
    x = np.arange(4, dtype=np.float32) + rank
    sums = [hora.allreduce_(x.copy(), op=hora.Sum, name="loop") for _ in range(5)]
    hora.synchronize(hora.allreduce_async(x, op=hora.Sum, name="engine.1"))
    hora.allgather(x, name="engine.2")
    BoardCalls._lane_wait = counted
    unwaited = stats.counters.lane_unwaited
    sums += [hora.allreduce_(x.copy(), op=hora.Sum, name="loop") for _ in range(steps)]
    return sums, stats.counters.lane_unwaited - unwaited + count["waits"]


def test_a_lane_looks_at_the_posts_after_the_engine_ran_collectives():
    """Rank 0's lane checks, on each call, that its engine has nothing under way, the
    requests its pacer holds among it (the pacer hands its list out and starts another):
    once the engine has run collectives and is idle again, the lane looks at the posts
    itself, and every result is right."""
    steps = 200
    results = run_ranks(_lane_after_engine_work, 2, timeout_s=40, args=(steps,))
    total = sum(np.arange(4, dtype=np.float32) + r for r in range(2))
    for rank, (sums, _) in enumerate(results):
        for i, got in enumerate(sums):
            _same_bits(got, total, f"rank {rank} call {i}")
    looked = results[0][1]
    assert looked >= steps - steps // 4, f"{looked} of {steps} calls looked at the posts"


def _lane_interrupted():
    """The loop's name is in flight (an asynchronous call of it, which the last rank joins
    late) when its blocking call comes; then the timeline records a few of its calls; then
    the loop goes on."""
    import tempfile

    from hora.core import build_info, timeline
    rank = hora.rank()
    x = np.arange(4, dtype=np.float32) + rank
    sums = [hora.allreduce_(x.copy(), op=hora.Sum, name="loop") for _ in range(10)]
    refused = None
    if rank == hora.size() - 1:         # the asynchronous call waits for this rank's
        time.sleep(0.3)
        h = hora.allreduce_async(x * 2, op=hora.Sum, name="loop")
    else:
        h = hora.allreduce_async(x * 2, op=hora.Sum, name="loop")
        try:
            hora.allreduce_(x.copy(), op=hora.Sum, name="loop")
        except hora.HoraError as e:
            refused = type(e).__name__
    sums.append(hora.synchronize(h))
    path = os.path.join(tempfile.gettempdir(), f"hora-lane-timeline-{os.getppid()}.json")
    build_info.start_timeline(path)
    sums += [hora.allreduce_(x.copy(), op=hora.Sum, name="loop") for _ in range(3)]
    build_info.stop_timeline()
    recorded = None
    if rank == 0:                   # rank 0's spans of "loop": its rounds on the board
        events = timeline.load(path)
        os.unlink(path)
        rows = {e["tid"] for e in events if e["name"] == "thread_name" and e["pid"] == 0
                and e["args"]["name"] == "loop"}
        recorded = sum(e["name"] == "ALLREDUCE board" and e.get("tid") in rows
                       and e["pid"] == 0 for e in events)
    sums += [hora.allreduce_(x.copy(), op=hora.Sum, name="loop") for _ in range(5)]
    return refused, sums, recorded


def test_a_lanes_name_in_flight_is_refused_and_the_timeline_sees_its_calls():
    """A lane's blocking call whose name an asynchronous call has in flight raises the
    engine's DuplicateNameError; while the timeline records, the calls stay on the board
    (a span a round); before, between and after, every result is right."""
    n = 3
    results = run_ranks(_lane_interrupted, n, timeout_s=40)
    total = sum(np.arange(4, dtype=np.float32) + r for r in range(n))
    for rank, (refused, sums, recorded) in enumerate(results):
        assert refused == (None if rank == n - 1 else "DuplicateNameError"), (rank, refused)
        for i, got in enumerate(sums):
            _same_bits(got, total * 2 if i == 10 else total, f"rank {rank} call {i}")
    assert results[0][2] == 3, f"the timeline recorded {results[0][2]} calls of 'loop'"


# -- 2. falling back: async calls, work in flight, late ranks, mismatches, threads ----------
def _x(i, rank, n=3):
    return np.arange(n, dtype=np.float64) + 10.0 * rank + i


def _async_and_blocking(async_rank, steps):
    """Name ``m.i``: ``async_rank`` submits it asynchronously, every other rank blocks; a
    plain blocking call ``p.i`` between them."""
    rank = hora.rank()
    outs = []
    for i in range(steps):
        if rank == async_rank:
            h = hora.allreduce_async(_x(i, rank), op=hora.Sum, name=f"m.{i}")
            if i % 2:
                time.sleep(0.01)
            m = hora.synchronize(h)
        else:
            m = hora.allreduce(_x(i, rank), op=hora.Sum, name=f"m.{i}")
        p = hora.allreduce(_x(i, rank, 2), op=hora.Max, name=f"p.{i}")
        outs.append((m, p))
    return outs, _board_count()


@pytest.mark.parametrize("n,async_rank", [(2, 0), (2, 1), (3, 2)])
def test_one_rank_async_the_others_blocking(n, async_rank):
    steps = 15
    results = run_ranks(_async_and_blocking, n, timeout_s=40, args=(async_rank, steps))
    for rank, (outs, board) in enumerate(results):
        for i, (m, p) in enumerate(outs):
            _same_bits(m, _expected([_x(i, r) for r in range(n)], "Sum"), f"rank {rank} m.{i}")
            _same_bits(p, _expected([_x(i, r, 2) for r in range(n)], "Max"),
                       f"rank {rank} p.{i}")
        # m.i can never settle on the board: at most the p.i did
        assert board <= steps, (rank, board)
    assert results[0][1] > 0, "no plain blocking allreduce went through the board"


BIG = max(1 << 18, 4 * F32)     # float32: 1 MiB, and well above the board's limit


def _big_in_flight(holder, steps):
    """``holder`` submits a 1 MiB allreduce early and holds it while every rank makes
    ``steps`` blocking small allreduces; the others submit it after them."""
    rank = hora.rank()
    big = np.full(BIG, rank + 1.0, np.float32)
    h = hora.allreduce_async(big, op=hora.Sum, name="big") if rank in holder else None
    smalls = [hora.allreduce(_x(i, rank), op=hora.Average, name=f"s.{i}")
              for i in range(steps)]
    if h is None:
        got = hora.allreduce(big, op=hora.Sum, name="big")
    else:
        got = hora.synchronize(h)
    after = hora.allreduce(_x(99, rank), op=hora.Sum, name="after")
    return smalls, got, after


@pytest.mark.parametrize("n,holder", [(2, (0,)), (2, (1,)), (3, (0, 1, 2))])
def test_an_async_big_allreduce_in_flight_during_blocking_small_ones(n, holder):
    steps = 10
    results = run_ranks(_big_in_flight, n, timeout_s=40, args=(holder, steps))
    total = sum(range(1, n + 1))
    for rank, (smalls, got, after) in enumerate(results):
        for i, s in enumerate(smalls):
            np.testing.assert_allclose(s, _expected([_x(i, r) for r in range(n)], "Average"),
                                       rtol=1e-15, err_msg=f"rank {rank} s.{i}")
            _same_bits(s, results[0][0][i], f"rank {rank} s.{i} vs rank 0")
        _same_bits(got, np.full(BIG, float(total), np.float32), f"rank {rank} big")
        _same_bits(after, _expected([_x(99, r) for r in range(n)], "Sum"), f"rank {rank} after")


def _mismatch_cases(rank, n):
    """name -> the call ``rank`` makes; rank 1 (or rank 0 for ``*.0``) disagrees."""
    f32 = np.float32
    one = rank == 1
    return {
        "m.shape": lambda: hora.allreduce(np.ones(3 + rank, f32), op=hora.Sum, name="m.shape"),
        "m.big1": lambda: hora.allreduce(np.ones(F32 + 1 if one else 4, f32), op=hora.Sum,
                                         name="m.big1"),
        "m.big0": lambda: hora.allreduce(np.ones(F32 + 1 if rank == 0 else 4, f32),
                                         op=hora.Sum, name="m.big0"),
        "m.dtype": lambda: hora.allreduce(np.ones(4, np.int32 if one else f32), op=hora.Sum,
                                          name="m.dtype"),
        "m.op": lambda: hora.allreduce(np.ones(4, f32), op=hora.Max if one else hora.Sum,
                                       name="m.op"),
        "m.kind": lambda: (hora.allgather(np.ones(4, f32), name="m.kind") if one else
                           hora.allreduce(np.ones(4, f32), op=hora.Sum, name="m.kind")),
        "m.inplace": lambda: (hora.allreduce_(np.ones(4 + rank, f32), op=hora.Sum,
                                              name="m.inplace")),
        # what the engine does with these is its own business: the board must agree with it
        "m.prescale": lambda: hora.allreduce(np.arange(4, dtype=f32) + rank, op=hora.Sum,
                                             prescale_factor=2.0 if one else 1.0,
                                             name="m.prescale"),
        "m.postscale": lambda: hora.allreduce(np.arange(4, dtype=f32) + rank, op=hora.Sum,
                                              postscale_factor=2.0 if one else 1.0,
                                              name="m.postscale"),
    }


def _mismatches(n):
    rank = hora.rank()
    out = {}
    for key, call in _mismatch_cases(rank, n).items():
        hora.allreduce(np.ones(1), op=hora.Sum, name=f"before.{key}")   # line the ranks up
        t = time.monotonic()
        try:
            got = ("ok", np.asarray(call()).copy())
        except Exception as e:  # noqa: BLE001 - compared with the engine's below
            got = ("error", type(e).__name__, str(e))
        out[key] = (got, time.monotonic() - t)
    after = hora.allreduce(np.full(2, rank + 1.0), op=hora.Sum, name="after")
    return out, after, hora.metrics()["data_plane"]


PRESCALE_ONLY = ("m.prescale", "m.postscale")


@pytest.mark.parametrize("n", [2, 3])
def test_mismatched_calls_raise_the_engines_error_on_every_rank(n):
    on = run_ranks(_mismatches, n, timeout_s=40, args=(n,))
    off = run_ranks(_mismatches, n, timeout_s=40, args=(n,), env=OFF)
    for rank in range(n):
        got_on, after, planes = on[rank]
        got_off = off[rank][0]
        for key, (res, took) in got_on.items():
            ref = got_off[key][0]
            assert took < 5.0, f"rank {rank} {key}: took {took:.1f} s"
            if key in PRESCALE_ONLY:
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
        # the lining-up calls and the last one, at least, went through the board
        assert planes.get("board", 0) >= len(got_on) + 1, planes


def _late(late_rank, delay):
    rank = hora.rank()
    hora.allreduce(np.ones(1), name="warm")
    if rank == late_rank:
        time.sleep(delay)
    t = time.monotonic()
    first = hora.allreduce(_x(1, rank), op=hora.Sum, name="late")
    took = time.monotonic() - t
    board = _board_count()
    second = hora.allreduce(_x(2, rank), op=hora.Min, name="next")
    return first, second, took, board


@pytest.mark.parametrize("n,late_rank", [(2, 1), (3, 2), (3, 0)])
def test_a_rank_later_than_the_boards_patience(n, late_rank):
    # > board_rules.PATIENCE_S.  A late rank 0: its engine answers the posts waiting for it at its
    # periodic looks (0.5 s apart), so the posts must have waited PATIENCE_S by one of them
    # well before it comes (else its own call may settle them on the board, rightly)
    delay = 2.5 if late_rank == 0 else 1.5
    results = run_ranks(_late, n, timeout_s=40, args=(late_rank, delay))
    for rank, (first, second, took, board) in enumerate(results):
        _same_bits(first, _expected([_x(1, r) for r in range(n)], "Sum"), f"rank {rank}")
        _same_bits(second, _expected([_x(2, r) for r in range(n)], "Min"), f"rank {rank}")
        if rank == late_rank:
            # it finds the others in the engine: no second wait for the board's patience
            assert took < 0.9, f"the late rank {rank} waited {took:.2f} s more"
        else:
            assert took < delay + 2.0, f"rank {rank} took {took:.2f} s"
        assert board == 1, f"rank {rank}: {board} on the board, expected only the warm-up"


def _ag(i, rank):
    return np.full((rank % 3 + 1, 2), 1000 * i + rank, np.int32)


def _bc(i, rank):
    return np.arange(4, dtype=np.float32) + 100 * rank + i


def _mixed(steps):
    """Each step: a blocking small allreduce, an allgather, a broadcast, a blocking
    allreduce_ of a 1 KiB array; meanwhile two threads make blocking allreduces of their
    own names."""
    rank, size = hora.rank(), hora.size()
    got = {"main": [], "A": [], "B": []}
    errors = []

    def thread(tag):
        try:
            for i in range(steps):
                if tag == "A":
                    v = np.array([i, rank, 1], np.int64)
                    got[tag].append(hora.allreduce(v, op=hora.Sum, name=f"A.{i}"))
                else:
                    v = np.full(2, 2.0 * rank + i)
                    got[tag].append(hora.allreduce(v, op=hora.Average, name=f"B.{i}"))
        except BaseException as e:  # reported by the test
            errors.append(f"thread {tag}: {e!r}")

    threads = [threading.Thread(target=thread, args=(t,)) for t in "AB"]
    for th in threads:
        th.start()
    for i in range(steps):
        a = hora.allreduce(_x(i, rank), op=hora.Sum, name=f"s.{i}")
        g = hora.allgather(_ag(i, rank), name=f"g.{i}")
        b = hora.broadcast(_bc(i, rank), root_rank=i % size, name=f"b.{i}")
        c = np.full(256, float(rank + i), np.float32)
        hora.allreduce_(c, op=hora.Max, name=f"c.{i}")
        got["main"].append((a, g, b, c))
    for th in threads:
        th.join(30)
    assert not any(th.is_alive() for th in threads), "a thread hung"
    return got, errors, _board_count()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3])
def test_many_mixed_collectives_and_threads(n):
    steps = 300
    results = run_ranks(_mixed, n, timeout_s=40, args=(steps,))
    for rank, (got, errors, board) in enumerate(results):
        assert not errors, (rank, errors)
        assert len(got["main"]) == len(got["A"]) == len(got["B"]) == steps
        for i, (a, g, b, c) in enumerate(got["main"]):
            _same_bits(a, _expected([_x(i, r) for r in range(n)], "Sum"), f"rank {rank} s.{i}")
            _same_bits(g, np.concatenate([_ag(i, r) for r in range(n)]), f"rank {rank} g.{i}")
            _same_bits(b, _bc(i, i % n), f"rank {rank} b.{i}")
            _same_bits(c, np.full(256, float(n - 1 + i), np.float32), f"rank {rank} c.{i}")
        for i in range(steps):
            _same_bits(got["A"][i], np.array([n * i, n * (n - 1) // 2, n], np.int64),
                       f"rank {rank} A.{i}")
            np.testing.assert_allclose(got["B"][i], np.full(2, n - 1.0 + i), rtol=1e-15)
        assert board > 0, f"rank {rank}: nothing went through the board"


# -- 3. failures: a dead rank, while the others wait on the board ---------------------------
def _die_during_board(victim, how):
    """``victim`` dies while the others wait on the board: before its call (``kill``,
    ``exit``), or in it (``posted``: 0.3 s into the call, which the rank ``late`` joins only
    1 s after the others; a worker's post is on the board then)."""
    hora.init()
    rank = hora.rank()
    hora.allreduce(np.ones(4), op=hora.Sum, name="warm")
    warm_board = _board_count()
    if how == "posted":
        late = 1 if victim == 0 else 0
        if rank == victim:
            def die_soon():
                time.sleep(0.3)
                os.kill(os.getpid(), signal.SIGKILL)
            with open(os.environ["DEATH_FILE"], "w") as f:
                f.write(repr(time.time() + 0.3))
            threading.Thread(target=die_soon, daemon=True).start()
        elif rank == late:
            time.sleep(1.0)
    elif rank == victim:
        time.sleep(0.5)                 # the others are waiting in the next call by now
        with open(os.environ["DEATH_FILE"], "w") as f:
            f.write(repr(time.time()))
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        hora.allreduce(np.ones(4), op=hora.Sum, name="lost")
        return ("finished", warm_board)
    except hora.HorovodInternalError as e:
        return (type(e).__name__, getattr(e, "rank", None), str(e), time.time(), warm_board)


@pytest.mark.parametrize("n,victim,how", [(2, 1, "kill"), (3, 0, "kill"), (3, 1, "exit"),
                                          (3, 2, "posted"), (3, 0, "posted")])
def test_survivors_of_a_dead_rank_fail_naming_it_within_seconds(tmp_path, n, victim, how):
    job, killed_at, survived = until_one_dies(_die_during_board, n, tmp_path, victim,
                                              args=(victim, how))
    for r, got in survived.items():
        kind, rank, message, at, warm_board = got
        assert warm_board == 1, f"rank {r}: the warm-up did not go through the board"
        assert kind == "HoraRankFailedError" and rank == victim, got
        assert f"rank {victim}" in message, message
        assert at - killed_at < 5.0, f"rank {r} took {at - killed_at:.1f} s to notice"
    pids = {p.pid for p in job.procs}
    assert _hora_files(pids) == [], "segments left in /dev/shm"


def _die_in_a_loop(victim, delay, repeat=False):
    """Every rank loops over board allreduces (small ones and, where the board stripes its
    large ones, striped ones); ``victim`` dies ``delay`` s into the loop, at no particular
    point of one.  ``repeat``: each step calls the same two names (their lanes)."""
    hora.init()
    rank = hora.rank()
    hora.allreduce(np.ones(4), op=hora.Sum, name="warm")
    big = STRIPE_BYTES // 4 + 5 if STRIPE_BYTES and STRIPE_BYTES <= _capacity(hora.size()) \
        else 1000
    if rank == victim:
        die_in(delay)
    steps = 0
    try:
        while True:
            small = hora.allreduce(np.full(3, steps + 1.0), op=hora.Sum,
                                   name="s" if repeat else f"s.{steps}")
            large = hora.allreduce(np.full(big, steps + 1.0, np.float32), op=hora.Max,
                                   name="l" if repeat else f"l.{steps}")
            if small[0] != hora.size() * (steps + 1.0) or large[-1] != steps + 1.0:
                return ("wrong", steps, small, large[-1])
            steps += 1
            if steps > 100_000:
                return ("finished", steps)
    except hora.HorovodInternalError as e:
        return (type(e).__name__, getattr(e, "rank", None), str(e), time.time(), steps,
                _board_count())


@pytest.mark.parametrize("victim,repeat", [(1, False), (0, False), (1, True), (0, True)])
def test_a_rank_dying_at_any_point_of_a_board_loop(tmp_path, victim, repeat):
    n = 3
    job, killed_at, survived = until_one_dies(_die_in_a_loop, n, tmp_path, victim,
                                              args=(victim, 0.4, repeat))
    for r, got in survived.items():
        assert got[0] == "HoraRankFailedError", got
        kind, rank, message, at, steps, board = got
        assert rank == victim and f"rank {victim}" in message, got
        assert steps > 0 and board > 0, f"rank {r}: {steps} steps, {board} on the board"
        assert at - killed_at < 5.0, f"rank {r} took {at - killed_at:.1f} s to notice"
    assert _hora_files({p.pid for p in job.procs}) == []


def _stopped_in_a_call(victim, where, pid_file):
    """``victim`` stops itself (SIGSTOP) in the middle of a board call: ``"stripe"`` before
    reducing its stripe of a striped allreduce, ``"answer"`` (rank 0) while every worker's
    post waits for its answer.  The others wait until HORA_TRANSPORT_TIMEOUT, then raise;
    then they let the victim go on (SIGCONT)."""
    hora.init()
    rank = hora.rank()
    hora.allreduce(np.ones(4), op=hora.Sum, name="warm")
    if rank == victim:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
        from hora.core.engine.lanes import Lane
        # (a striped call reduces through its lane, or through the board's general path)
        methods = ([(Lane, "reduce_stripe"), (_board.Board, "reduce_stripe")]
                   if where == "stripe" else [(_board.Board, "open_posts")])
        reals = {(c, m): getattr(c, m) for c, m in methods}

        def stopping(method):
            def stop_once(self, *args):
                for (c, m), real in reals.items():
                    setattr(c, m, real)
                with open(os.environ["STOP_FILE"], "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
                return reals[method](self, *args)
            return stop_once
        for c, m in methods:
            setattr(c, m, stopping((c, m)))
    n = STRIPE_BYTES // 4 + 5 if where == "stripe" else 3
    try:
        hora.allreduce(np.ones(n, np.float32), op=hora.Sum, name="stalled")
        return ("finished",)
    except Exception as e:      # noqa: BLE001 - which error is what the test looks at
        at = time.time()
        if rank != victim:          # once every other rank has raised too
            time.sleep(1.0)
            os.kill(int(open(pid_file).read()), signal.SIGCONT)
        return (type(e).__name__, str(e), at)


@pytest.mark.skipif(not STRIPE_BYTES, reason="the board does not stripe")
@pytest.mark.parametrize("victim,where", [(2, "stripe"), (0, "stripe"), (0, "answer")])
def test_a_rank_stopped_in_a_board_call_times_out_the_others(tmp_path, victim, where):
    """A rank alive but stopped in the middle of a board call: the others raise the
    transport's CollectiveTimeoutError after HORA_TRANSPORT_TIMEOUT, naming it, as a
    transfer stalled by a stopped peer does."""
    stop_file = tmp_path / "stopped"
    n = 3
    results = run_ranks(_stopped_in_a_call, n, timeout_s=40,
                        args=(victim, where, str(tmp_path / "pid")),
                        env={"HORA_TRANSPORT_TIMEOUT": "2", "STOP_FILE": str(stop_file)})
    stopped_at = float(stop_file.read_text())
    for r, got in enumerate(results):
        if r == victim:
            continue
        kind, message, at = got
        assert kind == "CollectiveTimeoutError", got
        assert "'stalled'" in message and "HORA_TRANSPORT_TIMEOUT" in message, message
        named = "rank 0 did not answer" if where == "answer" else f"[{victim}]"
        assert named in message, message
        assert 1.5 < at - stopped_at < 8.0, f"rank {r} raised {at - stopped_at:.1f} s after"


# -- 4. join: joined ranks add zeros ------------------------------------------------------
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


@pytest.mark.parametrize("n,joiner", [(2, 1), (2, 0), (3, 1), (3, 0)])
def test_a_joined_rank_contributes_zeros(n, joiner):
    """Horovod's join: a joined rank adds zeros to the others' allreduces, and an average
    still divides by every rank (as the engine does, hora.core.engine.executor)."""
    steps = 8
    results = run_ranks(_join_early, n, timeout_s=40, args=(joiner, steps))
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


# -- 5. /dev/shm: the board's segment is unlinked once mapped ------------------------------
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


# -- 6. hora.torch --------------------------------------------------------------------------
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
