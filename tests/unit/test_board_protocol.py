"""The board's protocol on one mapping seen by several Board objects (one per rank) in one
process: posts, rank 0's answers, fallbacks by patience and when busy, striped reductions.
The multi-process behaviour is tests/multiproc/test_board.py's."""
import mmap
import threading
import time

import numpy as np
import pytest

from hora.backends import board_segment as seg
from hora.core.engine import board as b
from hora.core.engine.board_rules import NUDGE_S, PATIENCE_S, stale
from hora.core.engine.lanes import make_lane
from hora.core.messages import ALLREDUCE, Average, Max, Min, Product, Request, Sum
from hora.errors import CollectiveTimeoutError

pytestmark = pytest.mark.skipif(not seg.supported(), reason="the board needs x86-64 Linux")


def _boards(n, **kw):
    mapping = mmap.mmap(-1, seg.board_bytes(n))
    return [b.Board(mapping, r, n, spin_s=0.0, crowded=False, **kw) for r in range(n)]


def _req(name, count, op=Sum, dtype="<f4", pre=1.0, post=1.0):
    return Request(name, ALLREDUCE, dtype, ((count,),), op, -1, pre, post, None, 0, "")


def _want(inputs, pre, post, size):
    """Prescale each float32 input, reduce in rank order, then postscale / size."""
    acc = inputs[0] * np.float32(pre)
    for x in inputs[1:]:
        acc = acc + x * np.float32(pre)
    return acc * np.float32(post / size)


def _post_all(boards, req, inputs):
    return {r: boards[r].post(boards[r].signature(req), req, [inputs[r]], inputs[r].nbytes)
            for r in range(1, len(boards))}


def test_one_host_every_rank_reduces_every_input_in_rank_order():
    boards = _boards(3)
    req = _req("g", 5, op=Average, pre=2.0, post=0.5)
    inputs = [np.arange(5, dtype=np.float32) * (r + 1) + r for r in range(3)]
    seqs = _post_all(boards, req, inputs)
    for r in (1, 2):
        assert boards[r].reply(seqs[r]) == 0            # nothing answered yet
    rank0 = boards[0]
    posts = rank0.open_posts()
    assert posts == seqs
    assert rank0.matches(posts, rank0.signature(req), inputs[0].nbytes)
    rank0.stage(req, [inputs[0]], inputs[0].nbytes)
    rank0.answer(posts, b.SHARED)
    assert rank0.open_posts() == {}                      # each post is answered once
    want = _want(inputs, 2.0, 0.5, 3)
    for r in (1, 2):
        assert boards[r].reply(seqs[r]) == b.SHARED
    for r in (0, 1, 2):
        if r == 1:                                      # into the caller's array
            out = np.empty(5, np.float32)
            assert boards[r].reduce_shared(req, want.nbytes, out) is out
        else:                                           # into the board's buffer
            out = boards[r].reduce_shared(req, want.nbytes)
        assert out.tobytes() == want.tobytes()


def test_a_slow_rank_reads_its_round_after_the_others_posted_the_next():
    """A rank may post its next input while a slower one still reduces the last round's:
    small inputs take turns between two areas of each slot, so the slow rank still reads
    the round it was told to reduce."""
    boards = _boards(3)
    req = _req("g", 4)
    first = [np.full(4, r + 1, np.float32) for r in range(3)]
    second = [np.full(4, 10 * (r + 1), np.float32) for r in range(3)]
    seqs = _post_all(boards, req, first)
    boards[0].stage(req, [first[0]], 16)
    boards[0].answer(boards[0].open_posts(), b.SHARED)
    assert boards[0].reduce_shared(req, 16).tolist() == [6.0] * 4
    assert boards[1].reply(seqs[1]) == b.SHARED
    assert boards[1].reduce_shared(req, 16).tolist() == [6.0] * 4
    # ranks 0 and 1 go on to the next round while rank 2 has not read the first
    boards[0].stage(req, [second[0]], 16)
    s1 = boards[1].post(boards[1].signature(req), req, [second[1]], 16)
    assert boards[2].reply(seqs[2]) == b.SHARED
    assert boards[2].reduce_shared(req, 16).tolist() == [6.0] * 4
    s2 = boards[2].post(boards[2].signature(req), req, [second[2]], 16)
    assert boards[0].open_posts() == {1: s1, 2: s2}
    boards[0].answer(boards[0].open_posts(), b.SHARED)
    for r in range(3):
        assert boards[r].reduce_shared(req, 16).tolist() == [60.0] * 4


def test_across_hosts_rank0_answers_with_the_reduction_in_the_result_area():
    """A host's rank 0 (leader) reduces its host's inputs in rank order (partial); the
    postscale comes once the hosts' partials are added; the workers read the result."""
    boards = _boards(3)
    req = _req("g", 5, op=Sum, pre=2.0, post=0.5)
    inputs = [np.arange(5, dtype=np.float32) * (r + 1) + r for r in range(3)]
    seqs = _post_all(boards, req, inputs)
    rank0 = boards[0]
    posts = rank0.open_posts()
    acc = rank0.combine(req, [rank0.partial(req, [inputs[0]], inputs[0].nbytes)],
                        inputs[0].nbytes)
    rank0.answer(posts, b.RESULT)
    want = _want(inputs, 2.0, 0.5, 1)
    assert acc.tobytes() == want.tobytes()
    for r in (1, 2):
        assert boards[r].reply(seqs[r]) == b.RESULT
        assert boards[r].result("<f4", want.nbytes).tobytes() == want.tobytes()


@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize("op,dtype", [(Sum, "<f4"), (Average, "<f8"), (Max, "<i4"),
                                      (Product, "<f4")])
def test_every_rank_and_a_leader_fold_in_rank_order_whatever_the_count(count, op, dtype):
    """One element takes a path of its own (numpy is slow on an output that is also an
    input): the bits stay those of the plain fold in rank order, on every rank and in a
    leader's partial."""
    n = 5
    rng = np.random.default_rng(count)
    inputs = [(rng.standard_normal(count) * 1e3).astype(dtype) for _ in range(n)]
    fn = {Sum: np.add, Average: np.add, Max: np.maximum, Product: np.multiply}[op]
    want = inputs[0].copy()
    for x in inputs[1:]:
        want = fn(want, x).astype(dtype)
    if op == Average:
        want = want * (1.0 / n)
    req = _req("f", count, op=op, dtype=dtype)
    nbytes = inputs[0].nbytes
    boards = _boards(n)
    seqs = _post_all(boards, req, inputs)
    rank0 = boards[0]
    rank0.stage(req, [inputs[0]], nbytes)
    rank0.answer(rank0.open_posts(), b.SHARED)
    for r in range(n):
        assert boards[r].reduce_shared(req, nbytes).tobytes() == want.tobytes()
    for r in range(1, n):
        assert boards[r].reply(seqs[r]) == b.SHARED
    boards = _boards(n)                                 # a leader's partial, another round
    _post_all(boards, req, inputs)
    acc = boards[0].combine(req, [boards[0].partial(req, [inputs[0]], nbytes)], nbytes)
    assert acc.tobytes() == want.tobytes()


@pytest.mark.parametrize("count", [0, 1, 3])
@pytest.mark.parametrize("op,dtype,post", [(Sum, "<f4", 1.0), (Sum, "<f4", 0.3),
                                           (Average, "<f4", 1.0), (Average, "<f8", 3.0),
                                           (Sum, "<f8", 1.0), (Min, "<f4", 1.0),
                                           (Product, "<f4", 1.0), (Sum, "<i8", 0.5)])
def test_leaders_add_the_hosts_parts_in_host_order_whatever_the_count(count, op, dtype, post):
    """Three hosts of 2, 1 and 3 ranks: each leader's part (its host's inputs in rank order)
    travels as bytes, and every leader adds the parts in host order and postscales (an
    Average divides by the job's size): the bits of numpy's fold of each host, then of the
    hosts, whichever path a count takes (one float of a Sum or an Average: Python floats)."""
    rng = np.random.default_rng(count + 7)
    sizes = (2, 1, 3)
    hosts = [[(rng.standard_normal(count) * 1e3).astype(dtype) for _ in range(k)]
             for k in sizes]
    fn = {Sum: np.add, Average: np.add, Min: np.minimum, Product: np.multiply}[op]

    def fold(xs):
        acc = xs[0].copy()
        for x in xs[1:]:
            acc = fn(acc, x).astype(dtype)
        return acc
    want = fold([fold(xs) for xs in hosts])
    factor = post / (sum(sizes) if op == Average else 1)
    if factor != 1:                 # as Horovod rounds: float32 by the factor in float32
        want = (np.trunc(want * factor) if want.dtype.kind == "i"
                else want * want.dtype.type(factor)).astype(dtype)
    req = _req("f", count, op=op, dtype=dtype, post=post)
    nbytes = want.nbytes
    leaders, parts = [], []
    for xs in hosts:
        boards = _boards(len(xs), job_size=sum(sizes), leaders=(0, 2, 3))
        _post_all(boards, req, xs)
        parts.append(boards[0].partial(req, [xs[0]], nbytes))
        leaders.append(boards)
    assert [len(p) for p in parts] == [nbytes] * 3
    for boards in leaders:
        got = boards[0].combine(req, list(parts), nbytes)
        assert got.tobytes() == want.tobytes()
        assert boards[0].result(dtype, nbytes).tobytes() == want.tobytes()


def test_a_different_signature_or_size_does_not_match():
    boards = _boards(2)
    a, other = _req("g", 4), _req("h", 4)
    x = np.ones(4, np.float32)
    boards[1].post(boards[1].signature(other), other, [x], x.nbytes)
    posts = boards[0].open_posts()
    assert not boards[0].matches(posts, boards[0].signature(a), x.nbytes)
    assert not boards[0].matches(posts, boards[0].signature(other), x.nbytes + 4)
    boards[0].answer(posts, b.FALLBACK)
    assert boards[1].reply(posts[1]) == b.FALLBACK


def test_stale_posts_fall_back_at_once_when_busy_else_after_their_patience():
    boards = _boards(3)
    req = _req("g", 2)
    x = np.ones(2, np.float32)

    def serve(busy, now):           # (what BoardCalls.serve does from every engine step)
        rank0 = boards[0]
        rank0.answer(stale(rank0.open_posts(), busy, rank0.seen, now), b.FALLBACK)

    s1 = boards[1].post(boards[1].signature(req), req, [x], x.nbytes)
    serve(False, 100.0)                                         # rank 0 may still come: wait
    assert boards[1].reply(s1) == 0
    serve(False, 100.0 + PATIENCE_S - 0.01)
    assert boards[1].reply(s1) == 0
    serve(False, 100.0 + PATIENCE_S)
    assert boards[1].reply(s1) == b.FALLBACK
    s2 = boards[2].post(boards[2].signature(req), req, [x], x.nbytes)
    serve(True, 200.0)                                          # rank 0's engine is under way
    assert boards[2].reply(s2) == b.FALLBACK
    # a new post of rank 1 is a new post: its patience starts again
    s3 = boards[1].post(boards[1].signature(req), req, [x], x.nbytes)
    serve(False, 300.0)
    assert boards[1].reply(s3) == 0


@pytest.mark.parametrize("form", ["one array", "two arrays", "prescaled", "strided"])
@pytest.mark.parametrize("n,count", [(2, 50_000), (3, 40_001), (4, 17)])
def test_striped_reduction_every_rank_a_stripe(n, count, form):
    """Every rank reduces its stripe of every input, in rank order.  From 256 KiB (the first
    two sizes), a rank's own stripe of one contiguous array is read from the array (it is
    not staged); grouped arrays, a prescale or a strided array are staged whole."""
    boards = _boards(n)
    pre = 2.0 if form == "prescaled" else 1.0
    req = _req("big", count, op=Sum, dtype="<f8", pre=pre, post=0.25)
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal(count) for _ in range(n)]
    nbytes = inputs[0].nbytes

    def given(x):
        if form == "two arrays":
            return [x[:count // 3], x[count // 3:]]
        if form == "strided":
            wide = np.zeros((count, 2))
            wide[:, 0] = x
            return [wide[:, 0]]
        return [x]
    seqs = {r: boards[r].post(boards[r].signature(req), req, given(inputs[r]), nbytes)
            for r in range(1, n)}
    boards[0].stage(req, given(inputs[0]), nbytes)
    posts = boards[0].open_posts()
    boards[0].answer(posts, b.GO)
    for r in range(1, n):
        assert boards[r].reply(seqs[r]) == b.GO
    for r in range(n):
        boards[r].reduce_stripe(req, nbytes)
    for r in range(n):
        assert boards[r].wait_stripes(lambda: True, "x")
    acc = inputs[0] * pre
    for r in range(1, n):
        acc = acc + inputs[r] * pre
    want = acc * 0.25
    for r in range(n):
        assert boards[r].result("<f8", nbytes).tobytes() == want.tobytes()


def test_waiting_for_stripes_gives_up_when_the_engine_stops():
    boards = _boards(2)
    req = _req("big", 1000, dtype="<f8")
    boards[0].reduce_stripe(req, 8000)                   # rank 1 never does its stripe
    assert boards[0].wait_stripes(lambda: False, "x") is False


@pytest.mark.parametrize("crowded", [False, True])
def test_waits_give_up_after_the_timeout_while_the_engine_lives(crowded):
    """A rank stopped in the middle of a call (alive, so its engine's sockets say nothing):
    after the board's timeout, waiting for its stripe or for rank 0's answer raises the
    transport's CollectiveTimeoutError naming it."""
    mapping = mmap.mmap(-1, seg.board_bytes(3))
    boards = [b.Board(mapping, r, 3, spin_s=0.0, crowded=crowded, timeout=0.3)
              for r in range(3)]
    req = _req("big", 1000, dtype="<f8")
    boards[0].reduce_stripe(req, 8000)                   # ranks 1 and 2 never do theirs
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=r"rank\(s\) \[1, 2\].*'big'"):
        boards[0].wait_stripes(lambda: True, "big")
    assert 0.3 <= time.monotonic() - t0 < 2.0
    seq = boards[1].post(boards[1].signature(req), req, [np.zeros(1000)], 8000)
    nudged = []
    with pytest.raises(CollectiveTimeoutError, match="rank 0 did not answer.*'big'"):
        boards[1].wait_reply(seq, lambda: True, lambda: nudged.append(1), NUDGE_S, "big")
    assert nudged == [1]
    boards[0].answer(boards[0].open_posts(), b.FALLBACK)         # a late answer still reaches it
    assert boards[1].reply(seq) == b.FALLBACK


def test_capacity_keeps_the_slots_within_16_mib():
    assert seg.board_capacity(2) == b.BOARD_BYTES
    assert seg.board_capacity(64) * 64 <= 16 << 20
    assert seg.board_capacity(10_000) == 8 << 10


def test_a_small_dev_shm_gets_smaller_boards():
    """A container's 64 MiB /dev/shm keeps boards of 1 MiB at most (5.5 MiB of segment for 4
    ranks, against 20.5), leaving the room to the shared-memory plane."""
    small = seg.board_limit(64 << 20)
    assert small == 1 << 20 and seg.board_limit(8 << 30) == b.BOARD_BYTES
    assert seg.board_capacity(4, small) == 1 << 20 and seg.board_capacity(64, small) == 256 << 10
    assert seg.board_bytes(4, small) < 6 << 20 < 20 << 20 < seg.board_bytes(4)
    mapping = mmap.mmap(-1, seg.board_bytes(4, small))
    board = b.Board(mapping, 1, 4, spin_s=0.0, crowded=False, limit=small)
    assert board.capacity == 1 << 20
    req = _req("g", (1 << 20) // 4)              # the largest input fits the segment
    board.post(board.signature(req), req, [np.ones((1 << 20) // 4, np.float32)], 1 << 20)


def _lane_of(board, req, count):
    a = np.zeros(count, np.float32)
    return make_lane(board, req, board.signature(req), a.nbytes, a.dtype, a.shape)


def test_rank_0_answers_a_lane_only_when_every_post_is_its_call():
    """Rank 0's lane looks at every post number and signature version at once: it answers
    when each worker's open post is the lane's call, names the first worker yet to post,
    and answers nothing (missing None) when a worker posted another collective; a later
    call of the lane, after the general path read the new signature, is answered again."""
    boards = _boards(4)
    rank0 = boards[0]
    req, other = _req("lane", 4), _req("other", 4)
    lanes = {r: _lane_of(boards[r], req, 4) for r in range(4)}
    inputs = [np.full(4, r + 1, np.float32) for r in range(4)]

    def post(r, call):
        x = inputs[r]
        return boards[r].post(boards[r].signature(call), call, [x], x.nbytes)

    def answered(seqs):
        return {r: boards[r].reply(seq) for r, seq in seqs.items()}

    # round 1: every worker posted, their signatures not read yet: to be read in full
    seqs = {r: post(r, req) for r in (1, 2, 3)}
    lanes[0].stage(inputs[0])
    assert not lanes[0].answer(b.SHARED)
    assert rank0.missing is None
    posts = rank0.open_posts()
    assert posts == seqs and rank0.matches(posts, lanes[0].sig, inputs[0].nbytes)
    assert lanes[0].answer(b.SHARED)        # (now known)
    assert answered(seqs) == {1: b.SHARED, 2: b.SHARED, 3: b.SHARED}
    assert rank0.open_posts() == {}                     # each post answered once
    assert not lanes[0].answer(b.SHARED)    # nobody posted again
    assert rank0.missing == 1
    for r in range(4):
        assert np.array_equal(lanes[r].fold_into(None), np.full(4, 10, np.float32))

    # round 2: rank 0 first, the workers after, one by one
    seqs = {}
    for r in (1, 2, 3):
        lanes[0].stage(inputs[0])
        assert not lanes[0].answer(b.SHARED)
        assert rank0.missing == r                       # the first one yet to post
        seqs[r] = post(r, req)
    assert lanes[0].answer(b.SHARED)
    assert answered(seqs) == {1: b.SHARED, 2: b.SHARED, 3: b.SHARED}
    for r in range(4):
        assert np.array_equal(lanes[r].fold_into(None), np.full(4, 10, np.float32))

    # round 3: rank 2 posts another collective: no answer for anybody, missing None
    seqs = {1: post(1, req), 2: post(2, other), 3: post(3, req)}
    assert not lanes[0].answer(b.SHARED)
    assert rank0.missing is None
    assert answered(seqs) == {1: 0, 2: 0, 3: 0}
    posts = rank0.open_posts()
    assert not rank0.matches(posts, lanes[0].sig, inputs[0].nbytes)  # (reads rank 2's)
    assert not lanes[0].answer(b.SHARED)    # still not the lane's call
    rank0.answer(posts, b.FALLBACK)
    assert answered(seqs) == {1: b.FALLBACK, 2: b.FALLBACK, 3: b.FALLBACK}

    # round 4: every worker back in the lane (rank 2 writes its signature again)
    seqs = {r: post(r, req) for r in (1, 2, 3)}
    assert not lanes[0].answer(b.SHARED)    # rank 2's new version: in full
    posts = rank0.open_posts()
    assert rank0.matches(posts, lanes[0].sig, inputs[0].nbytes)
    lanes[0].stage(inputs[0])
    assert lanes[0].answer(b.SHARED)
    assert answered(seqs) == {1: b.SHARED, 2: b.SHARED, 3: b.SHARED}
    assert lanes[0].open_posts() is None and rank0.missing == 1


@pytest.mark.timeout(10)
def test_a_waiting_rank_nudges_rank_0_only_when_it_is_not_in_a_call_of_its_own():
    """Rank 0 in a board call of its own sees every post as it comes: a post that waits
    does not nudge its engine then (at 64 ranks on 2 CPUs, five messages a 4 B allreduce),
    and does once rank 0 has left the call without answering it."""
    boards = _boards(2)
    req = _req("x", 4)
    seq = boards[1].post(boards[1].signature(req), req, [np.ones(4, np.float32)], 16)
    nudged = []

    def nudge():
        nudged.append(time.monotonic())
        boards[0].answer(boards[0].open_posts(), b.FALLBACK)     # the engine answers it

    boards[0].mark_in_call(True)
    left = []

    def leave_later():
        time.sleep(0.2)
        left.append(time.monotonic())
        boards[0].mark_in_call(False)
    t = threading.Thread(target=leave_later)
    t.start()
    assert boards[1].wait_reply(seq, lambda: True, nudge, NUDGE_S, "x") == b.FALLBACK
    t.join()
    assert len(nudged) == 1 and nudged[0] >= left[0]
