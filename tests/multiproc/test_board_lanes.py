"""The board's lanes (hora.core.engine.lanes, BoardCalls.lane_call): a blocking allreduce that
a loop repeats keeps its lane until the call changes (dtype, shape, layout, op, scale), on
every rank, with NumPy's bits of the inputs in rank order and the engine's where the board
is off; a lane's name in flight is refused.  (Rank 0's wait on its lane for late posts, a test
that runs alone: test_board_lanes_late.py.)"""
import os
import time

import numpy as np
import pytest

import hora
from tests.helpers import run_ranks
from tests.multiproc.board_oracle import board_count as _board_count
from tests.multiproc.board_oracle import expected as _expected
from tests.multiproc.board_oracle import same_bits as _same_bits
from tests.multiproc.board_oracle import OFF

pytestmark = pytest.mark.timeout(60)


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


# 2: the board off adds in NumPy's order (exact); 3: an odd number of stripes, and more ranks
# than a 2-CPU machine has (4 ran too, and took no path that 3 does not)
@pytest.mark.parametrize("n", [2, 3])
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
