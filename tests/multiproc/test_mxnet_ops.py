"""``hora.mxnet``'s collectives on real processes, checked against NumPy on the gathered inputs.

MXNet lives in a venv of its own (tests/mxnet_env.py): the workers run its interpreter.  One
job per N in 1 and 3 runs every section (each op on MXNet's dtypes, the in-place forms, scale
factors, a process set, objects, a shape mismatch) and returns plain lists, which load in
this process whatever its NumPy; the tests check one section each.  Every rank's inputs come
from (SEED, case, rank), so this process rebuilds them and computes the expected values.
"""
import time
import traceback
import zlib

import numpy as np
import pytest

from tests import mxnet_env
from tests.helpers import (block_bounds, caught as _caught, job_fixture, reduce_expected,
                           run_ranks, section)

SEED = 20261125
SIZES = [1, 3]      # hora.mxnet has no branch on N past 1 (the core's paths: test_collectives)
DTYPES = ["float32", "float64", "float16", "int32", "int64", "uint8"]
_TOL = {"float16": 2e-3, "float32": 2e-5, "float64": 1e-12}


def _rng(*key):
    return np.random.default_rng([SEED, zlib.crc32(repr(key).encode())])


def _values(key, dtype, shape):
    """Small integers: exact in every dtype and in sums and products of <= 3 terms."""
    x = _rng(*key).integers(0 if dtype == "uint8" else -5, 6, size=shape)
    return x.astype(dtype)


def allreduce_cases():
    cases = [(dt, op, (3, 4), 1.0, 1.0) for dt in DTYPES for op in ["Sum", "Average", "Min", "Max"]]
    return cases + [("float32", "Product", (5,), 1.0, 1.0), ("int32", "Product", (5,), 1.0, 1.0),
                    ("float32", "Sum", (5,), 0.5, 3.0), ("float64", "Average", (2,), 2.0, 0.5)]


def alltoall_splits(rank, n):
    return [int(v) for v in _rng("a2a-splits", rank).integers(0, 3, n)]


def _plain(y):
    """An NDArray as (dtype, shape, values, context) that any NumPy loads."""
    a = y.asnumpy()
    return str(a.dtype), a.shape, a.tolist(), str(y.context)


def _back(p):
    dtype, shape, values, _ = p
    return np.asarray(values, dtype=dtype).reshape(shape)


# -- the worker's sections -------------------------------------------------------------------
def _in(mx, key, dt, shape):
    return mx.nd.array(_values(key, dt, shape), dtype=dt)


def _sec_ops(hvd, mx, n):
    r, out = hvd.rank(), {}
    for case in allreduce_cases():
        dt, op, shape, pre, post = case
        out["ar", case] = hvd.allreduce(_in(mx, ("ar", case, r), dt, shape), op=getattr(hvd, op),
                                        prescale_factor=pre, postscale_factor=post)
    out["ar", "default"] = hvd.allreduce(_in(mx, ("dflt", r), "float32", (4,)))
    out["ar", "average=False"] = hvd.allreduce(_in(mx, ("avg", r), "int32", (4,)), average=False,
                                               name="avg.false", priority=3)
    grouped = [_in(mx, ("gar", j, r), dt, (2, j + 1)) for j, dt in enumerate(DTYPES)]
    for j, y in enumerate(hvd.grouped_allreduce(grouped, op=hvd.Sum)):
        out["gar", j] = y
    for dt in DTYPES:
        out["ag", dt] = hvd.allgather(_in(mx, ("ag", dt, r), dt, ((r + 1) % 3, 2)))
        out["bc", dt] = hvd.broadcast(_in(mx, ("bc", dt, r), dt, (2, 3)), root_rank=n - 1)
    for j, y in enumerate(hvd.grouped_allgather(
            [_in(mx, ("gag", j, r), "float32", ((r + 1) % 3, j + 1)) for j in range(2)])):
        out["gag", j] = y
    splits = alltoall_splits(r, n)
    out["a2a", "received"], out["a2a", "splits"] = hvd.alltoall(
        _in(mx, ("a2a", r), "float32", (sum(splits), 2)), splits=mx.nd.array(splits, dtype="int32"))
    out["a2a", "even"] = hvd.alltoall(_in(mx, ("a2a-even", r), "int64", (2 * n,)))
    for dt, op in [("float32", "Sum"), ("float32", "Average"), ("int32", "Sum")]:
        out["rs", dt, op] = hvd.reducescatter(_in(mx, ("rs", dt, op, r), dt, (2 * n + 1, 2)),
                                              op=getattr(hvd, op))
    for j, y in enumerate(hvd.grouped_reducescatter(
            [_in(mx, ("grs", j, r), "float64", (n + j, 2)) for j in range(2)], op=hvd.Sum)):
        out["grs", j] = y
    return {k: _plain(v) for k, v in out.items()}


def _sec_inplace(hvd, mx, n):
    """allreduce_, grouped_allreduce_, broadcast_: the argument holds the result and is
    returned."""
    r, out = hvd.rank(), {}
    x = _in(mx, ("ar_", r), "float32", (3, 2))
    out["ar_"] = (hvd.allreduce_(x, op=hvd.Sum, postscale_factor=2.0) is x, _plain(x))
    xs = [_in(mx, ("gar_", j, r), dt, (2,)) for j, dt in enumerate(["float64", "int32"])]
    ys = hvd.grouped_allreduce_(xs, op=hvd.Max)
    out["gar_"] = (all(a is b for a, b in zip(xs, ys)), [_plain(x) for x in xs])
    x = _in(mx, ("bc_", r), "uint8", (4,))
    out["bc_"] = (hvd.broadcast_(x, root_rank=0) is x, _plain(x))
    return out


def _sec_process_set(hvd, mx, n):
    """Ranks 0 and n-1 (one rank when N = 1); the others wait."""
    ps = hvd.add_process_set(sorted({0, n - 1}))
    r, out = hvd.rank(), {}
    if ps.included():
        x = _in(mx, ("ps", r), "float32", (2, 2))
        out = {"ar": _plain(hvd.allreduce(x, op=hvd.Sum, process_set=ps)),
               "avg": _plain(hvd.allreduce(x, process_set=ps)),
               "ag": _plain(hvd.allgather(x, process_set=ps)),
               "bc": _plain(hvd.broadcast(x, root_rank=n - 1, process_set=ps))}
    hvd.remove_process_set(ps)
    return out


def _sec_objects(hvd, mx, n):
    hvd.barrier()
    return {"bo": hvd.broadcast_object({"from": hvd.rank()}, root_rank=n - 1),
            "ao": hvd.allgather_object(("rank", hvd.rank())),
            "sizes": (hvd.size(), hvd.local_size(), hvd.cross_size(), hvd.is_initialized())}


def _sec_arguments(hvd, mx, n):
    """Alltoalls this rank cannot submit (rows that do not divide without splits, splits
    that do not sum to the first dimension or are not integers), and an allreduce on a set
    of rank 0 alone: each raises on the calling rank from its own check, before anything is
    submitted."""
    r = hvd.rank()
    out = {"uneven": _caught(lambda: hvd.alltoall(mx.nd.ones((n + 1,)))),
           "sum": _caught(lambda: hvd.alltoall(mx.nd.ones((n - 1,)),
                                               mx.nd.ones((n,), dtype="int32"))),
           "float": _caught(lambda: hvd.alltoall(mx.nd.ones((n,)),
                                                 mx.nd.ones((n,), dtype="float32")))}
    ps = hvd.add_process_set([0])
    out["nonmember"] = _caught(lambda: hvd.allreduce(mx.nd.ones((2,)) * r, process_set=ps))
    hvd.barrier()
    hvd.remove_process_set(ps)
    return out


def _sec_mismatch(hvd, mx, n):
    """Shapes (2 + rank,): every rank must raise, naming the collective, within seconds."""
    start = time.monotonic()
    try:
        hvd.allreduce(mx.nd.ones((2 + hvd.rank(),)), name="mismatched")
        return None
    except Exception as e:  # noqa: BLE001 - the test checks the type and message
        return [c.__name__ for c in type(e).__mro__], str(e), time.monotonic() - start


def _worker(n):
    import mxnet as mx

    import hora.mxnet as hvd
    sections = {"ops": _sec_ops, "inplace": _sec_inplace, "process_set": _sec_process_set,
                "objects": _sec_objects}
    if n > 1:
        sections["arguments"] = _sec_arguments
        sections["mismatch"] = _sec_mismatch
    out = {}
    for name, run in sections.items():
        try:
            out[name] = ("ok", run(hvd, mx, n))
        except Exception:
            out[name] = ("error", traceback.format_exc())
    return out


job = job_fixture(_worker, env_for=lambda n: mxnet_env.worker_env(), timeout_s=60,
                  runner=lambda *a, **kw: run_ranks(*a, python=mxnet_env.python(), **kw))
pytestmark = pytest.mark.timeout(90)


@pytest.mark.timeout(mxnet_env.PIP_TIMEOUT_S + 180)
def test_mxnet_venv_is_made_or_skips_with_the_reason():
    """First: makes the cached venv (once per machine), so later tests time only their jobs."""
    assert mxnet_env.python()


def _check(got, expected, dt, what):
    assert got.dtype == np.dtype(dt), f"{what}: dtype {got.dtype}, expected {dt}"
    tol = _TOL.get(dt, 0)
    np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), rtol=tol,
                               atol=tol, err_msg=what)


@pytest.mark.parametrize("n", SIZES)
def test_allreduce_every_dtype_op_and_scale(job, n):
    results = section(job(n), "ops")
    for r, res in enumerate(results):
        for case in allreduce_cases():
            dt, op, shape, pre, post = case
            xs = [_values(("ar", case, k), dt, shape) for k in range(n)]
            _check(_back(res["ar", case]), reduce_expected(xs, op, pre, post), dt,
                   f"n={n} rank {r} allreduce {case}")
            assert res["ar", case][3] == "cpu(0)"
        xs = [_values(("dflt", k), "float32", (4,)) for k in range(n)]
        _check(_back(res["ar", "default"]), reduce_expected(xs, "Average"), "float32", "default")
        xs = [_values(("avg", k), "int32", (4,)) for k in range(n)]
        _check(_back(res["ar", "average=False"]), reduce_expected(xs, "Sum"), "int32",
               "average=False")
        for j, dt in enumerate(DTYPES):
            xs = [_values(("gar", j, k), dt, (2, j + 1)) for k in range(n)]
            _check(_back(res["gar", j]), reduce_expected(xs, "Sum"), dt, f"grouped {j}")


@pytest.mark.parametrize("n", SIZES)
def test_allgather_broadcast_alltoall_reducescatter(job, n):
    for r, res in enumerate(section(job(n), "ops")):
        for dt in DTYPES:
            xs = [_values(("ag", dt, k), dt, ((k + 1) % 3, 2)) for k in range(n)]
            _check(_back(res["ag", dt]), np.concatenate(xs), dt, f"allgather {dt}")
            _check(_back(res["bc", dt]), _values(("bc", dt, n - 1), dt, (2, 3)), dt,
                   f"broadcast {dt}")
        for j in range(2):
            xs = [_values(("gag", j, k), "float32", ((k + 1) % 3, j + 1)) for k in range(n)]
            _check(_back(res["gag", j]), np.concatenate(xs), "float32", f"grouped_allgather {j}")
        sent = [np.split(_values(("a2a", k), "float32", (sum(alltoall_splits(k, n)), 2)),
                         np.cumsum(alltoall_splits(k, n))[:-1]) for k in range(n)]
        _check(_back(res["a2a", "received"]), np.concatenate([sent[k][r] for k in range(n)]),
               "float32", "alltoall")
        _check(_back(res["a2a", "splits"]),
               np.asarray([alltoall_splits(k, n)[r] for k in range(n)]), "int32", "splits")
        even = [_values(("a2a-even", k), "int64", (2 * n,)) for k in range(n)]
        _check(_back(res["a2a", "even"]),
               np.concatenate([e[2 * r:2 * r + 2] for e in even]), "int64", "alltoall even")
        for dt, op in [("float32", "Sum"), ("float32", "Average"), ("int32", "Sum")]:
            xs = [_values(("rs", dt, op, k), dt, (2 * n + 1, 2)) for k in range(n)]
            lo, hi = block_bounds(2 * n + 1, n)[r:r + 2]
            _check(_back(res["rs", dt, op]), reduce_expected(xs, op)[lo:hi], dt,
                   f"reducescatter {dt} {op}")
        for j in range(2):
            xs = [_values(("grs", j, k), "float64", (n + j, 2)) for k in range(n)]
            lo, hi = block_bounds(n + j, n)[r:r + 2]
            _check(_back(res["grs", j]), reduce_expected(xs, "Sum")[lo:hi], "float64",
                   f"grouped_reducescatter {j}")


@pytest.mark.parametrize("n", SIZES)
def test_in_place_forms_change_their_argument(job, n):
    for r, res in enumerate(section(job(n), "inplace")):
        same, got = res["ar_"]
        xs = [_values(("ar_", k), "float32", (3, 2)) for k in range(n)]
        assert same, "allreduce_ must return its argument"
        _check(_back(got), reduce_expected(xs, "Sum", 1.0, 2.0), "float32", "allreduce_")
        same, got = res["gar_"]
        assert same, "grouped_allreduce_ must return its arguments"
        for j, dt in enumerate(["float64", "int32"]):
            xs = [_values(("gar_", j, k), dt, (2,)) for k in range(n)]
            _check(_back(got[j]), reduce_expected(xs, "Max"), dt, f"grouped_allreduce_ {j}")
        same, got = res["bc_"]
        assert same, "broadcast_ must return its argument"
        _check(_back(got), _values(("bc_", 0), "uint8", (4,)), "uint8", "broadcast_")


@pytest.mark.parametrize("n", SIZES)
def test_process_set_and_objects(job, n):
    members = sorted({0, n - 1})
    results = job(n)
    for r, res in enumerate(section(results, "process_set")):
        if r not in members:
            assert res == {}
            continue
        xs = [_values(("ps", k), "float32", (2, 2)) for k in members]
        _check(_back(res["ar"]), reduce_expected(xs, "Sum"), "float32", "process set sum")
        _check(_back(res["avg"]), reduce_expected(xs, "Average"), "float32", "process set avg")
        _check(_back(res["ag"]), np.concatenate(xs), "float32", "process set allgather")
        _check(_back(res["bc"]), xs[-1], "float32", "process set broadcast")
    for res in section(results, "objects"):
        assert res["bo"] == {"from": n - 1}
        assert res["ao"] == [("rank", k) for k in range(n)]
        assert res["sizes"] == (n, n, 1, True)


@pytest.mark.parametrize("n", [3])
def test_alltoall_arguments_and_nonmembers_raise_both_errors(job, n):
    """InvalidArgumentError: a ValueError and a RuntimeError alike, as MXNet's users catch it."""
    results = section(job(n), "arguments")
    for r, out in enumerate(results):
        for key in ("uneven", "sum", "float"):
            assert out[key] is not None and out[key][1] and out[key][2], (r, key, out[key])
    assert results[0]["nonmember"] is None
    for r, out in enumerate(results[1:], start=1):
        assert out["nonmember"][1] and "not a member" in out["nonmember"][3], (r, out)


@pytest.mark.parametrize("n", [3])
def test_shape_mismatch_raises_on_every_rank_within_seconds(job, n):
    for r, res in enumerate(section(job(n), "mismatch")):
        assert res is not None, f"rank {r}: a mismatched allreduce returned"
        mro, message, seconds = res
        assert "CollectiveMismatchError" in mro, (r, mro, message)
        assert "mismatched" in message and "shape" in message, message
        assert seconds < 10, f"rank {r} took {seconds:.1f} s to fail"
