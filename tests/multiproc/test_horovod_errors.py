"""Horovod's public behaviour for failing collectives and for scaling, on real ranks.

* Horovod code catches collective failures as ``RuntimeError``: every error a collective
  raises on every rank (mismatched shape, dtype, op, root, kind; a joined rank; a dead rank)
  is one, and the job stays usable after a mismatch.
* An alltoall without splits whose rows do not divide among the ranks fails on every rank
  that calls it so, from its own check.
* ``prescale_factor``/``postscale_factor`` round as Horovod's CPU scaling does; the oracle
  here is a NumPy model of that arithmetic (float16 in float32, float32 by a float32 factor,
  integers in float64 and truncated, an average folded into the postscale factor), on
  inputs whose sums are exact, so only the scaling's rounding is compared, bit for bit.
* A rank whose own call fails its argument checks raises there, and the ranks that
  submitted the collective raise ``CollectiveAbortedError`` at once naming it, instead of
  stalling (Horovod leaves them waiting).
"""
import functools
import os
import time

import numpy as np
import pytest

import hora
from tests.helpers import RawJob, run_ranks

pytestmark = pytest.mark.timeout(60)


# -- every collective error is a RuntimeError, and the job goes on -------------------------
def _mismatch_cases(r):
    """name -> the call rank ``r`` makes (ranks 0 and 1 disagree)."""
    return {
        "shape": lambda: hora.allreduce(np.ones(2 + r), name="m.shape"),
        "dtype": lambda: hora.allreduce(np.ones(3, np.float32 if r else np.float64),
                                        name="m.dtype"),
        "op": lambda: hora.allreduce(np.ones(3), op=hora.Max if r else hora.Sum, name="m.op"),
        "root": lambda: hora.broadcast(np.ones(3), root_rank=r, name="m.root"),
        "kind": lambda: (hora.allgather(np.ones(3), name="m.kind") if r else
                         hora.broadcast(np.ones(3), root_rank=0, name="m.kind")),
        "alltoall_rows": lambda: hora.alltoall(np.arange(3.0), name="m.a2a"),
    }


def _horovod_idiom_worker():
    """What Horovod code does: ``except RuntimeError``, then carry on."""
    r, caught = hora.rank(), {}
    for key, call in _mismatch_cases(r).items():
        try:
            call()
            caught[key] = None
        except RuntimeError as e:
            caught[key] = (type(e).__name__, str(e))
    # a rank that has joined: only allreduce runs until every rank has joined
    for kind in ("broadcast", "allgather"):
        if r == 1:
            hora.join()
        else:
            try:
                if kind == "broadcast":
                    hora.broadcast(np.ones(2), root_rank=0, name="j.b")
                else:
                    hora.allgather(np.ones(2), name="j.g")
                caught[kind, "joined"] = None
            except RuntimeError as e:
                caught[kind, "joined"] = (type(e).__name__, str(e))
            hora.join()
    return caught, hora.allreduce(np.array([r, 1.0]), op=hora.Sum, name="after")


def test_every_collective_error_is_a_runtime_error_and_the_job_goes_on():
    results = run_ranks(_horovod_idiom_worker, 2, timeout_s=40)
    needles = {"shape": ("'m.shape'", "shapes"), "dtype": ("'m.dtype'", "data types"),
               "op": ("'m.op'", "reduce ops"), "root": ("'m.root'", "root ranks"),
               "kind": ("'m.kind'", "collective kinds"),
               "alltoall_rows": ("'m.a2a'", "not a multiple of the number of ranks (2)")}
    for r, (caught, after) in enumerate(results):
        for key, words in needles.items():
            assert caught[key] is not None, f"rank {r}: {key} mismatch raised nothing"
            name, text = caught[key]
            # an alltoall's rows are this rank's own check (Horovod's invalid argument)
            want = "InvalidArgumentError" if key == "alltoall_rows" else "CollectiveMismatchError"
            assert name == want, (r, key, name, text)
            assert all(w in text for w in words), (r, key, text)
        if r == 0:
            for kind in ("broadcast", "allgather"):
                name, text = caught[kind, "joined"]
                assert name == "CollectiveMismatchError" and "rank 1 called join()" in text
        np.testing.assert_array_equal(after, [1.0, 2.0])


def _dies_mid_job():
    hora.init()
    hora.allreduce(np.ones(4), name="warm")
    if hora.rank() == 1:
        os._exit(3)
    try:
        hora.allreduce(np.ones(4), name="lost")
        return "no error"
    except RuntimeError as e:
        return type(e).__name__, getattr(e, "rank", None)


def test_a_dead_rank_is_caught_as_runtime_error(tmp_path):
    job = RawJob(_dies_mid_job, 2, tmp_path)
    survivor, dead = job.results(timeout_s=30)
    assert dead is None
    assert survivor == ("ok", ("HoraRankFailedError", 1)), (survivor, job.stderr(0)[-2000:])


# -- scaling: Horovod's CPU arithmetic, bit for bit ------------------------------------------
def _horovod_scale(x, factor):
    """Horovod's ScaleBuffer on the CPU, for one dtype."""
    if factor == 1:
        return x
    if x.dtype == np.float16:
        return (x.astype(np.float32) * np.float32(factor)).astype(np.float16)
    if x.dtype == np.float32:
        return x * np.float32(factor)
    if x.dtype == np.float64:
        return x * factor
    return np.trunc(x.astype(np.float64) * factor).astype(x.dtype)


def horovod_allreduce(xs, op, pre, post):
    post = post / len(xs) if op == "Average" else post
    return _horovod_scale(functools.reduce(np.add, [_horovod_scale(x, pre) for x in xs]), post)


_SCALE_DTYPES = ["float16", "float32", "float64", "int8", "int32", "int64", "uint8"]
# (op, prescale, postscale): prescales that keep the inputs' sums exact in every dtype, so
# the sum's order does not matter, and postscales that round
_SCALINGS = [("Average", 1.0, 1.0), ("Average", 0.5, 1.0), ("Sum", 1.0, 0.1),
             ("Average", 2.0, 0.7), ("Sum", 0.25, 1 / 3), ("Average", 1.0, 1.5),
             ("Sum", 1.0, 0.3)]
# 11 elements travel with their request (rank 0 reduces them); 40 000 take the data plane
_LENGTHS = [11, 40_000]


def _scale_input(dtype, length, case, rank):
    rng = np.random.default_rng([20261125, rank, length, _SCALE_DTYPES.index(dtype), case + 1])
    lo = 0 if dtype.startswith("uint") else -20
    return rng.integers(lo, 21, length).astype(dtype)


def _scale_cases(n):
    cases = [(dt, length, i) for dt in _SCALE_DTYPES for length in _LENGTHS
             for i in range(len(_SCALINGS))]
    if n == 2:        # a prescale that rounds: the sum of two is one rounding, in any order
        cases += [(dt, length, -1) for dt in ("float16", "float32") for length in _LENGTHS]
    return cases


def _scaling(i):
    return ("Sum", 0.1, 1.0) if i == -1 else _SCALINGS[i]


def _scale_worker(n):
    out = {}
    for dt, length, i in _scale_cases(n):
        op, pre, post = _scaling(i)
        x = _scale_input(dt, length, i, hora.rank())
        out[dt, length, i, "allreduce"] = hora.allreduce(
            x, op=getattr(hora, op), prescale_factor=pre, postscale_factor=post)
        out[dt, length, i, "reducescatter"] = hora.reducescatter(
            x[:length - length % n], op=getattr(hora, op), prescale_factor=pre,
            postscale_factor=post)
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_scaled_results_equal_horovods_bit_for_bit(n):
    results = run_ranks(_scale_worker, n, timeout_s=50, args=(n,))
    for dt, length, i in _scale_cases(n):
        op, pre, post = _scaling(i)
        xs = [_scale_input(dt, length, i, r) for r in range(n)]
        expected = horovod_allreduce(xs, op, pre, post)
        rows = (length - length % n) // n
        for r, got in enumerate(results):
            what = f"{dt}[{length}] {op} pre={pre} post={post:.4g} rank {r}"
            ar, rs = got[dt, length, i, "allreduce"], got[dt, length, i, "reducescatter"]
            assert ar.dtype == expected.dtype and ar.tobytes() == expected.tobytes(), \
                f"allreduce {what}: {ar[:6]} != {expected[:6]}"
            block = expected[r * rows:(r + 1) * rows]
            assert rs.tobytes() == block.tobytes(), f"reducescatter {what}: {rs[:6]}"


# -- one rank's failed argument check reaches the others ------------------------------------
class _Unpicklable:
    def __reduce__(self):
        raise TypeError("this object refuses to be pickled")


def _one_rank_fails_its_checks():
    """Rank 1's calls fail their own checks; rank 0's are fine and must not wait forever."""
    r, out = hora.rank(), {}
    calls = {
        "named": lambda: hora.allreduce(np.ones(2) if r == 0 else "abc", name="x"),
        "unnamed": lambda: hora.allreduce(np.ones(3) if r == 0 else np.ones(3, bool)),
        "broadcast": lambda: hora.broadcast(np.ones(2), root_rank=0 if r == 0 else "zero",
                                            name="b"),
        "grouped_allgather": lambda: hora.grouped_allgather(
            [np.ones(2), np.ones(1) if r == 0 else object()], name="g"),
        "object": lambda: hora.broadcast_object(
            {"fine": 1} if r == 0 else _Unpicklable(), root_rank=1),
    }
    for key, call in calls.items():
        started = time.monotonic()
        try:
            call()
            out[key] = (None, None, time.monotonic() - started)
        except Exception as e:  # noqa: BLE001 - what each rank saw is the result
            out[key] = (type(e).__name__, str(e), time.monotonic() - started,
                        getattr(e, "ranks", None))
    # the job is still usable, and unnamed collectives are still in step on both ranks
    after = (hora.allreduce(np.array([r + 1.0]), op=hora.Sum),
             hora.allreduce(np.array([2.0 * r]), op=hora.Sum, name="x"))
    return out, after


def test_a_failed_argument_check_fails_the_other_ranks_at_once():
    results = run_ranks(_one_rank_fails_its_checks, 2, timeout_s=45,
                        env={"HORA_STALL_CHECK_TIME_SECONDS": "60"})
    (theirs, after0), (mine, after1) = results
    local = {"named": "TypeError", "unnamed": "TypeError", "broadcast": "TypeError",
             "grouped_allgather": "TypeError", "object": "TypeError"}
    names = {"named": "'x'", "unnamed": "allreduce.noname.", "broadcast": "'b'",
             "grouped_allgather": "'g.0'", "object": ".len'"}
    for key, exc in local.items():
        assert mine[key][0] == exc, (key, mine[key])
        assert mine[key][2] < 2.0, f"{key}: the failing rank took {mine[key][2]:.1f} s to raise"
        name, text, took, ranks = theirs[key]
        assert name == "CollectiveAbortedError", (key, theirs[key])
        assert "rank 1" in text and exc in text and names[key] in text, (key, text)
        assert list(ranks) == [1] and ranks[1].startswith(exc), (key, ranks)
        # well inside the stall inspector's first warning (60 s): no stall
        assert took < 10.0, f"{key}: rank 0 waited {took:.1f} s"
    # the named call's error says what rank 1's check said
    assert "unsupported dtype" in theirs["named"][1], theirs["named"][1]
    for after in (after0, after1):
        np.testing.assert_array_equal(after[0], [3.0])
        np.testing.assert_array_equal(after[1], [2.0])


def _two_ranks_fail_differently():
    r = hora.rank()
    arg = {0: np.ones(2), 1: "text", 2: np.ones(2, bool)}[r]
    try:
        hora.allreduce(arg, name="y")
        return None
    except Exception as e:  # noqa: BLE001 - the result is what was raised
        return type(e).__name__, str(e)


def test_ranks_that_fail_differently_are_all_named():
    rank0, rank1, rank2 = run_ranks(_two_ranks_fail_differently, 3, timeout_s=40)
    assert rank1[0] == "TypeError" and rank2[0] == "TypeError"
    name, text = rank0
    assert name == "CollectiveAbortedError", rank0
    assert "ranks 1, 2" in text and "unsupported dtype <U4" in text and "bool arrays" in text, text


def _refused_then_again(steps):
    """Every rank calls an in-place allreduce on a read-only array (refused), catches the
    error and makes the call again at once, writable; ``steps`` times, between calls of the
    same name that a loop repeats."""
    r = hora.rank()
    out = []
    for i in range(steps):
        x = np.arange(4, dtype=np.float32) + r + i
        before = hora.allreduce_(x.copy(), op=hora.Sum, name="loop")
        y = x.copy()
        y.flags.writeable = False
        try:
            hora.allreduce_(y, op=hora.Sum, name="loop")
            refused = None
        except Exception as e:  # noqa: BLE001 - what each rank saw is the result
            refused = type(e).__name__
        again = hora.allreduce_(y.copy(), op=hora.Sum, name="loop")
        out.append((refused, before, again))
    return out


@pytest.mark.parametrize("board", ["1", "0"])
def test_a_refused_call_can_be_made_again_at_once(board):
    """The refused call's stand-in (which tells the other ranks) holds its name until every
    rank has submitted it; the same call made again at once waits for that instead of
    raising DuplicateNameError."""
    n, steps = 3, 20
    results = run_ranks(_refused_then_again, n, timeout_s=40, args=(steps,),
                        env={"HORA_SHM_BOARD": board})
    for r, out in enumerate(results):
        for i, (refused, before, again) in enumerate(out):
            want = sum(np.arange(4, dtype=np.float32) + k + i for k in range(n))
            assert refused == "ValueError", (r, i, refused)
            np.testing.assert_array_equal(before, want, err_msg=f"rank {r} step {i}")
            np.testing.assert_array_equal(again, want, err_msg=f"rank {r} step {i} again")


def _torch_rank_without_a_gradient():
    """Rank 1 broadcasts a parameter's ``.grad`` that backward never filled (None)."""
    import torch

    import hora.torch as hvd
    p = torch.nn.Parameter(torch.ones(3))
    if hvd.rank() == 0:
        (p * 2).sum().backward()
    out = {}
    for key, call in {"broadcast": lambda: hvd.broadcast(p.grad, 0, name="grad.p"),
                      "allreduce": lambda: hvd.allreduce(p.grad),
                      "grouped": lambda: hvd.grouped_allgather([p.detach(), p.grad])}.items():
        started = time.monotonic()
        try:
            call()
            out[key] = None
        except Exception as e:  # noqa: BLE001 - what each rank saw is the result
            out[key] = (type(e).__name__, str(e), time.monotonic() - started)
    return out, hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()


def test_a_torch_argument_check_on_one_rank_fails_the_others():
    theirs, mine = run_ranks(_torch_rank_without_a_gradient, 2, timeout_s=45)
    for key in ("broadcast", "allreduce", "grouped"):
        assert mine[0][key][0] == "TypeError" and "NoneType" in mine[0][key][1], mine[0][key]
        name, text, took = theirs[0][key]
        assert name == "CollectiveAbortedError" and "rank 1" in text, (key, theirs[0][key])
        assert "NoneType" in text and took < 10.0, (key, text, took)
    assert "'grad.p'" in theirs[0]["broadcast"][1]
    assert theirs[1] == mine[1] == 2.0
