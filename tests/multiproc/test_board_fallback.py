"""The board falls back to the engine whenever it cannot settle a call for certain: another
rank's call is asynchronous, holds a big collective in flight, is late, disagrees, or runs
collectives from threads; every value is right, a mismatch raises the engine's error on
every rank, and nothing hangs.

The asynchronous rank, the big allreduce in flight and the threads need no job of their own:
one job per N (``job``, 2 and 3 ranks) runs each of their cases in turn (each counts what
went through the board from its own start), and each test checks its own case.  The late
ranks (timed from init) and the mismatches (the board on and off) keep their own jobs."""
import functools
import threading
import time

import numpy as np
import pytest

import hora
from tests.helpers import job_fixture, run_ranks, run_sections, section
from tests.multiproc.board_oracle import attempt as _attempt
from tests.multiproc.board_oracle import check_as_engine as _check_as_engine
from tests.multiproc.board_oracle import board_count as _board_count
from tests.multiproc.board_oracle import expected as _expected
from tests.multiproc.board_oracle import same_bits as _same_bits
from tests.multiproc.board_oracle import F32, OFF, step_input as _x

pytestmark = pytest.mark.timeout(60)


# -- falling back: async calls, work in flight, late ranks, mismatches, threads ----------
def _async_and_blocking(async_rank, steps):
    """Name ``m.i``: ``async_rank`` submits it asynchronously, every other rank blocks; a
    plain blocking call ``p.i`` between them."""
    rank = hora.rank()
    before = _board_count()
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
    return outs, _board_count() - before


ASYNC_STEPS, HELD_STEPS, MIXED_STEPS = 15, 10, 300
# the cases of each N's job: its asynchronous ranks, the holders of the big allreduce
ASYNC = {2: (0, 1), 3: (2,)}
HOLDERS = {2: ((0,), (1,)), 3: ((0, 1, 2),)}


def _cases(n):
    """Every case of the ``n``-rank job, in order (the threads last)."""
    parts = {f"async.{r}": functools.partial(_async_and_blocking, r, ASYNC_STEPS)
             for r in ASYNC[n]}
    parts.update({f"held.{holder}": functools.partial(_big_in_flight, holder, HELD_STEPS)
                  for holder in HOLDERS[n]})
    parts["mixed"] = functools.partial(_mixed, MIXED_STEPS)
    return run_sections(parts)


job = job_fixture(_cases, timeout_s=80)


@pytest.mark.parametrize("n,async_rank", [(2, 0), (2, 1), (3, 2)])
def test_one_rank_async_the_others_blocking(job, n, async_rank):
    steps = ASYNC_STEPS
    results = section(job(n), f"async.{async_rank}")
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
def test_an_async_big_allreduce_in_flight_during_blocking_small_ones(job, n, holder):
    results = section(job(n), f"held.{holder}")
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
        out[key] = _attempt(call)
    after = hora.allreduce(np.full(2, rank + 1.0), op=hora.Sum, name="after")
    return out, after, hora.metrics()["data_plane"]


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
            _check_as_engine(rank, key, res, ref)
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
    before = _board_count()
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
    return got, errors, _board_count() - before


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3])
def test_many_mixed_collectives_and_threads(job, n):
    steps = MIXED_STEPS
    results = section(job(n), "mixed")
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
