"""Blocking broadcasts and allgathers of small host arrays on the board (hora.core.engine.board),
on real ranks: every rank reads what the others put in their slots, in one SHARED round.

* Results are the root's input (broadcast) or every rank's input concatenated in rank order
  (allgather, with a different number of rows on each rank, none included), computed here
  from the inputs each rank returns; ``broadcast_object`` and ``allgather_object`` give back
  the objects.  The board settles exactly the calls below STRIPE_BYTES (counted in every rank
  by wrapping the board's two readers); larger ones, and everything with
  ``HORA_SHM_BOARD=0``, go through the engine with the same results.
* Calls that disagree (root, shape, trailing dimensions, kind) raise the engine's error on
  every rank, within seconds, and the job goes on; with a rank joined, or one rank's call
  asynchronous, every rank gets what the engine alone gives.
* A rank killed in a loop of them is named by the others within seconds; nothing stays in
  /dev/shm.

Per N (2 and 3), one job with the board on and one with it off run the calls, the
disagreeing calls and the joined rank in turn (``jobs``); each test checks its own part.
"""
import time

import numpy as np
import pytest

import hora
import hora.core.engine.board as _board
from hora.backends import board_segment
from tests.helpers import die_in, run_ranks, run_sections, section, until_one_dies
from tests.multiproc.board_oracle import attempt as _attempt
from tests.multiproc.board_oracle import hora_files

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not board_segment.supported(), reason="the board needs x86-64 Linux")]

OFF = {"HORA_SHM_BOARD": "0"}
STRIPE = _board.STRIPE_BYTES


def _count_board_reads():
    """Count, in this rank, the calls the board settled (its readers of a SHARED broadcast
    and allgather)."""
    seen = {"broadcast": 0, "allgather": 0}
    copy, gathered = _board.Board.copy_shared, _board.Board.gathered

    def copy_shared(self, req, nbytes):
        seen["broadcast"] += 1
        return copy(self, req, nbytes)

    def gathered_(self, req):
        seen["allgather"] += 1
        return gathered(self, req)

    _board.Board.copy_shared, _board.Board.gathered = copy_shared, gathered_
    return seen


def _data(i, rank, dtype, shape):
    rng = np.random.default_rng([i, rank])
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        return rng.integers(-1000, 1000, size=shape).astype(dtype)
    return (rng.standard_normal(shape) * 100).astype(dtype)


# (tag, dtype, shape) of broadcasts; each runs from every root in turn
BCASTS = [
    ("f32.1", "float32", (1,)),
    ("f64.0d", "float64", ()),
    ("f16.3x4", "float16", (3, 4)),
    ("i64.7", "int64", (7,)),
    ("bool.9", "bool", (9,)),
    ("u8.empty", "uint8", (0,)),
    ("f32.under", "float32", (STRIPE // 4 - 1,)),
    ("f32.at", "float32", (STRIPE // 4,)),                 # the engine's
]


def _gather_rows(tag, rank):
    """The rows rank ``rank`` brings to allgather ``tag``."""
    return {"none.1": 0 if rank == 1 else rank + 1,
            "big": STRIPE // 16 - 1 + rank}.get(tag, rank + 2)


# (tag, dtype, trailing dimensions) of allgathers
GATHERS = [
    ("f32", "float32", ()),
    ("i32.2x3", "int32", (2, 3)),
    ("f64.4", "float64", (4,)),
    ("bool", "bool", (5,)),
    ("none.1", "float32", (2,)),
    ("big", "float64", (2,)),       # each rank's just under STRIPE_BYTES, or over: a mix
    ("empty.row", "float32", (3, 0)),   # rows of no elements: the engine's
]


def _calls():
    """Every rank's broadcasts (from each root), allgathers, objects, with small allreduces
    in between (the SHARED rounds take turns between two areas of each slot)."""
    rank, n = hora.rank(), hora.size()
    seen = _count_board_reads()
    out = {"bcast": [], "gather": [], "objects": None, "allreduce": []}
    i = 0
    for tag, dtype, shape in BCASTS:
        for root in range(n):
            i += 1
            x = _data(i, rank, dtype, shape)
            got = hora.broadcast(x, root, name=f"b.{tag}.{root}")
            out["bcast"].append((tag, root, x, np.array(got, copy=True), got.shape))
            if i % 3 == 0:
                out["allreduce"].append(hora.allreduce(np.full(2, float(rank + i)), op=hora.Sum,
                                                       name=f"ar.{i}"))
    for tag, dtype, tail in GATHERS:
        i += 1
        x = _data(i, rank, dtype, (_gather_rows(tag, rank),) + tail)
        got = hora.allgather(x, name=f"g.{tag}")
        out["gather"].append((tag, x, np.array(got, copy=True)))
        out["allreduce"].append(hora.allreduce(np.full(2, float(rank + i)), op=hora.Sum,
                                               name=f"ar.{i}"))
    zero_d = hora.allgather(np.float64(rank + 0.5), name="g.0d")
    out["objects"] = (hora.broadcast_object({"from": rank, "list": [rank] * 3}, n - 1),
                      hora.allgather_object(("rank", rank, "x" * rank)), zero_d)
    return out, dict(seen)


def _sections():
    # the calls first (their counts of board reads start from none); the disagreeing calls,
    # after which the job goes on; last the joined rank (every rank back after it)
    return run_sections({"calls": _calls, "mismatches": _mismatches,
                         "joined": _joined_and_async})


@pytest.fixture(scope="module", params=[2, 3])
def jobs(request):
    """One job of every section on ``n`` ranks with the board on, and one with it off."""
    n = request.param
    return n, run_ranks(_sections, n, timeout_s=80), run_ranks(_sections, n, timeout_s=80,
                                                               env=OFF)


@pytest.fixture
def job(jobs):
    n, on, off = jobs
    return n, section(on, "calls"), section(off, "calls")


def test_broadcast_gives_every_rank_the_roots_input(job):
    n, on, off = job
    for results in (on, off):
        for rank in range(n):
            for k, (tag, root, _, got, shape) in enumerate(results[rank][0]["bcast"]):
                want = results[root][0]["bcast"][k][2]
                assert shape == want.shape, (rank, tag, root)
                assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), \
                    (rank, tag, root)


def test_allgather_concatenates_every_ranks_rows_in_rank_order(job):
    n, on, off = job
    for results in (on, off):
        for rank in range(n):
            for k, (tag, _, got) in enumerate(results[rank][0]["gather"]):
                want = np.concatenate([results[r][0]["gather"][k][1] for r in range(n)])
                assert got.shape == want.shape and got.dtype == want.dtype, (rank, tag)
                assert got.tobytes() == want.tobytes(), (rank, tag)


def test_objects_and_the_allreduces_between(job):
    n, on, off = job
    for results in (on, off):
        for rank in range(n):
            out = results[rank][0]
            obj, objs, zero_d = out["objects"]
            assert obj == {"from": n - 1, "list": [n - 1] * 3}
            assert objs == [("rank", r, "x" * r) for r in range(n)]
            np.testing.assert_array_equal(zero_d, np.arange(n) + 0.5)
            for got, want in zip(out["allreduce"], results[0][0]["allreduce"]):
                assert got.tobytes() == want.tobytes()
            assert out["allreduce"][0].tolist() == [float(sum(r + 3 for r in range(n)))] * 2


def test_the_board_settles_exactly_the_small_ones(job):
    n, on, off = job
    # broadcasts below STRIPE_BYTES (all but f32.at), from each root, plus the two of
    # broadcast_object; allgathers where every rank's input is below it (not "big", where
    # one is over; not "empty.row"), plus the 0-d one and the two of allgather_object
    bcasts = (len(BCASTS) - 1) * n + 2
    big = all(_gather_rows("big", r) * 2 * 8 < STRIPE for r in range(n))
    gathers = len(GATHERS) - 2 + big + 3
    for rank in range(n):
        assert on[rank][1] == {"broadcast": bcasts, "allgather": gathers}, (rank, on[rank][1])
        assert off[rank][1] == {"broadcast": 0, "allgather": 0}, (rank, off[rank][1])


def _mismatch_cases(rank):
    one = rank == 1
    f32 = np.float32
    return {
        "root": lambda: hora.broadcast(np.ones(3, f32), 1 if one else 0, name="root"),
        "shape": lambda: hora.broadcast(np.ones(3 + one, f32), 0, name="shape"),
        "dtype": lambda: hora.broadcast(np.ones(3, np.int32 if one else f32), 0, name="dtype"),
        "tail": lambda: hora.allgather(np.ones((2, 3 + one), f32), name="tail"),
        "kind": lambda: (hora.allgather(np.ones(3, f32), name="kind") if one else
                         hora.broadcast(np.ones(3, f32), 0, name="kind")),
        "bad root": lambda: hora.broadcast(np.ones(3, f32), 7, name="bad root"),
    }


def _mismatches():
    rank = hora.rank()
    seen = _count_board_reads()
    out = {}
    for key, call in _mismatch_cases(rank).items():
        hora.barrier()
        out[key] = _attempt(call, as_list=True)
    after = hora.broadcast(np.arange(3.0) + rank, hora.size() - 1, name="after")
    return out, after.tolist(), dict(seen)


def test_disagreeing_calls_raise_the_engines_error_on_every_rank(jobs):
    n, on, off = jobs
    on, off = section(on, "mismatches"), section(off, "mismatches")
    for rank in range(n):
        got_on, after, seen = on[rank]
        for key, (res, took) in got_on.items():
            ref = off[rank][0][key][0]
            assert took < 5.0, (rank, key, took)
            assert ref[0] == "error", (rank, key, ref)
            assert res[:2] == ref[:2], (rank, key, res, ref)
            assert f"'{key}'" in res[2] or key == "bad root", (rank, key, res)
        assert after == [float(n - 1), float(n), float(n + 1)]
        assert seen["broadcast"] == 1, seen         # "after": the job goes on, on the board


def _torch_calls():
    import torch

    import hora.torch as hvd
    rank = hvd.rank()
    seen = _count_board_reads()
    t = torch.arange(4, dtype=torch.float32) + 10 * rank
    hvd.broadcast_(t, 1, name="t.bcast_")
    g = hvd.allgather(torch.full((rank + 1, 2), float(rank)), name="t.gather")
    return t.tolist(), g.tolist(), dict(seen)


def test_torch_broadcast_and_allgather_of_cpu_tensors_take_the_board():
    pytest.importorskip("torch")
    for t, g, seen in run_ranks(_torch_calls, 2, timeout_s=50):
        assert t == [10.0, 11.0, 12.0, 13.0]
        assert g == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert seen == {"broadcast": 1, "allgather": 1}, seen


def _joined_and_async():
    """Rank 1 has joined while the others broadcast and allgather (the engine refuses
    those); then, everyone back, rank 0 broadcasts and allgathers asynchronously while the
    others block."""
    rank = hora.rank()
    out = []

    def attempt(call):
        try:
            return ("ok", np.asarray(call()).tolist())
        except Exception as e:  # noqa: BLE001 - compared with the engine's below
            return ("error", type(e).__name__, str(e))

    if rank != 1:
        out.append(attempt(lambda: hora.broadcast(np.arange(3.0) + rank, 0, name="j.b")))
        out.append(attempt(lambda: hora.allgather(np.arange(2.0) + rank, name="j.g")))
    out.append(("joined", hora.join()))
    x = np.arange(3.0) + rank
    if rank == 0:
        b = hora.synchronize(hora.broadcast_async(x, 2 % hora.size(), name="a.b"))
        g = hora.synchronize(hora.allgather_async(x[:rank + 1], name="a.g"))
    else:
        b = hora.broadcast(x, 2 % hora.size(), name="a.b")
        g = hora.allgather(x[:rank + 1], name="a.g")
    out.append(("ok", b.tolist(), g.tolist()))
    return out


def test_a_joined_rank_and_an_async_rank_behave_as_on_the_engine(jobs):
    n, on, off = jobs
    on, off = section(on, "joined"), section(off, "joined")
    assert on == off
    root = 2 % n
    for rank in range(n):
        if rank != 1:
            assert [r[:2] for r in on[rank][:2]] == [("error", "CollectiveMismatchError")] * 2
        assert on[rank][-1] == ("ok", [root, root + 1.0, root + 2.0],
                                [x for r in range(n) for x in range(r, 2 * r + 1)])


def _die_in_a_loop(victim, delay):
    """Every rank loops over board broadcasts and allgathers; ``victim`` dies ``delay`` s
    into the loop, at no particular point of a call."""
    hora.init()
    rank, n = hora.rank(), hora.size()
    seen = _count_board_reads()
    hora.barrier()
    if rank == victim:
        die_in(delay)
    steps = 0
    try:
        while steps < 100_000:
            b = hora.broadcast(np.full(3, steps + rank, np.float32), steps % n, name=f"b.{steps}")
            g = hora.allgather(np.full(rank + 1, steps, np.int64), name=f"g.{steps}")
            if b[0] != steps + steps % n or g.size != n * (n + 1) // 2 or g[0] != steps:
                return ("wrong", steps, b.tolist(), g.tolist())
            steps += 1
        return ("finished", steps)
    except hora.HorovodInternalError as e:
        return (type(e).__name__, getattr(e, "rank", None), str(e), time.time(), steps,
                dict(seen))


@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_dying_in_a_loop_of_broadcasts_and_allgathers(tmp_path, victim):
    job, killed_at, survived = until_one_dies(_die_in_a_loop, 3, tmp_path, victim,
                                              args=(victim, 0.4))
    for r, got in survived.items():
        assert got[0] == "HoraRankFailedError", got
        _, rank, message, at, steps, seen = got
        assert rank == victim and f"rank {victim}" in message, got
        assert steps > 0 and seen["broadcast"] > 0 and seen["allgather"] > 0, (r, steps, seen)
        assert at - killed_at < 5.0, f"rank {r} took {at - killed_at:.1f} s to notice"
    assert hora_files({p.pid for p in job.procs}) == [], "segments left in /dev/shm"
