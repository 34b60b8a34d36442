"""``hora.jax``'s collectives on real processes, checked against NumPy on the gathered inputs.

One job of 3 ranks runs every section (each op eagerly and inside one ``jax.jit``,
gradients by ``jax.grad`` both ways, pytrees, compression, process sets, the asynchronous
forms, a shape mismatch and a bad argument on one rank) and returns plain NumPy values; the
tests below check one section each.  Every rank's inputs come from (SEED, case, rank), so this
process rebuilds them and computes the expected values with NumPy.  JAX is imported by the
workers only.

Three ranks, and only three: the binding's code is the same for every N (it has no branch on
the job's size; the core's one-rank path is test_collectives.py's job of 1 rank), and N=3 is the
one small N where the process set of ranks 0 and N-1 maps a rank to another set rank (global
2 is set rank 1) and leaves a rank outside it, where reducescatter's blocks are uneven and
the mismatch and bad-argument errors reach more than one other rank.  A job of 2 ranks
checks a subset of that; one of 1 rank checks the core, not the binding.
"""
import importlib.util
import traceback
import warnings
import zlib

import numpy as np
import pytest

from tests.helpers import (block_bounds, call_case, caught as _caught, job_fixture,
                           reduce_expected, section)

if importlib.util.find_spec("jax") is None:
    pytest.skip("JAX is not installed (pip install 'hora[jax]')", allow_module_level=True)

SEED = 20261125
SIZES = [3]
# JAX without jax_enable_x64 has no 64-bit types
DTYPES = ["uint8", "int8", "int32", "float16", "bfloat16", "float32", "bool"]
_TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-5}
MODES = ["eager", "jit"]


def _rng(*key):
    return np.random.default_rng([SEED, zlib.crc32(repr(key).encode())])


def _values(key, dtype, shape):
    """Small integers (exact in every dtype and in sums of <= 3 terms), or bools; bfloat16
    comes back as float32 (the worker casts)."""
    rng = _rng(*key)
    if dtype == "bool":
        return rng.random(shape) < 0.4
    x = rng.integers(0 if dtype == "uint8" else -8, 9, size=shape)
    return x.astype("float32" if dtype == "bfloat16" else dtype)


def allreduce_cases():
    cases = []
    for dt in DTYPES:
        ops = ["Sum", "Min", "Max"] if dt == "bool" else ["Sum", "Average", "Min", "Max"]
        cases += [(dt, op, (3, 4), 1.0, 1.0) for op in ops]
    return cases + [("float32", "Product", (5,), 1.0, 1.0), ("int32", "Product", (5,), 1.0, 1.0),
                    ("float32", "Sum", (5,), 0.5, 3.0), ("float32", "Average", (), 2.0, 0.5)]


def gather_rows(rank, mode):
    """Eagerly 1, 2, 0 rows (one rank sends none at N = 3); in jit the same on every rank."""
    return (rank + 1) % 3 if mode == "eager" else 2


def alltoall_splits(rank, n):
    return [int(v) for v in _rng("a2a-splits", rank).integers(0, 3, n)]


# -- the worker's sections -------------------------------------------------------------------
def _in(jnp, key, dt, shape):
    return jnp.asarray(_values(key, dt, shape)).astype(getattr(jnp, dt))


def _out(y):
    """(dtype name, NumPy array; bfloat16 as float32)."""
    name = str(y.dtype)
    return name, np.asarray(y.astype("float32") if name == "bfloat16" else y)


def _collectives(hvd, jnp, n, mode):
    r, out = hvd.rank(), {}
    for case in allreduce_cases():
        dt, op, shape, pre, post = case
        out["ar", case] = hvd.allreduce(_in(jnp, ("ar", case, r), dt, shape),
                                        op=getattr(hvd, op), prescale_factor=pre,
                                        postscale_factor=post)
    out["ar", "default"] = hvd.allreduce(_in(jnp, ("dflt", r), "float32", (4,)))
    out["ar", "average=False"] = hvd.allreduce(_in(jnp, ("avg", r), "int32", (4,)),
                                               average=False)
    grouped = [_in(jnp, ("gar", j, r), dt, (2, j + 1))
               for j, dt in enumerate(["float32", "int32", "bfloat16"])]
    for j, y in enumerate(hvd.grouped_allreduce(grouped, op=hvd.Sum)):
        out["gar", j] = y
    tree = hvd.allreduce({"a": _in(jnp, ("tree", "a", r), "float32", (3,)),
                          "b": [_in(jnp, ("tree", "b", r), "int8", (2, 2))]}, op=hvd.Sum)
    out["tree", "a"], out["tree", "b"] = tree["a"], tree["b"][0]
    for dt in DTYPES:
        out["ag", dt] = hvd.allgather(_in(jnp, ("ag", dt, r), dt, (gather_rows(r, mode), 2)))
        out["bc", dt] = hvd.broadcast(_in(jnp, ("bc", dt, r), dt, (2, 3)), root_rank=n - 1)
    for j, y in enumerate(hvd.grouped_allgather(
            [_in(jnp, ("gag", j, r), "float32", (gather_rows(r, mode), j + 1))
             for j in range(2)])):
        out["gag", j] = y
    if mode == "eager":
        splits = alltoall_splits(r, n)
        out["a2a", "splits"], out["a2a", "received"] = hvd.alltoall(
            _in(jnp, ("a2a", r), "float32", (sum(splits), 2)), splits=splits)
    out["a2a", "even"] = hvd.alltoall(_in(jnp, ("a2a-even", r), "bfloat16", (2 * n,)))
    for dt, op in [("float32", "Sum"), ("float32", "Average"), ("int32", "Sum")]:
        out["rs", dt, op] = hvd.reducescatter(_in(jnp, ("rs", dt, op, r), dt, (2 * n + 1, 2)),
                                              op=getattr(hvd, op))
    for j, y in enumerate(hvd.grouped_reducescatter(
            [_in(jnp, ("grs", j, r), "float32", (n + j, 2)) for j in range(2)], op=hvd.Sum)):
        out["grs", j] = y
    out["fp16", "float32"] = hvd.allreduce(_in(jnp, ("fp16", r), "float32", (6,)), op=hvd.Sum,
                                           compression=hvd.Compression.fp16)
    out["fp16", "int32"] = hvd.allreduce(_in(jnp, ("fp16i", r), "int32", (6,)), op=hvd.Sum,
                                         compression=hvd.Compression.fp16)
    return out


def _sec_ops(hvd, jax, jnp, n, mode):
    if mode == "eager":
        res = _collectives(hvd, jnp, n, mode)
    else:                           # a list out of jit: pytrees cannot sort these keys
        keys = []

        def traced():
            res = _collectives(hvd, jnp, n, mode)
            keys.extend(res)
            return list(res.values())
        res = dict(zip(keys, jax.jit(traced)()))
    return {k: _out(v) for k, v in res.items()}


# gradients of sum(w_r * op(x)), w_r = (1 + arange) * (r + 1), against Horovod's definitions
GRAD_CASES = [("allreduce", "Sum"), ("allreduce", "Average"), ("grouped_allreduce", "Sum"),
              ("allgather", None), ("broadcast", None), ("reducescatter", "Sum"),
              ("reducescatter", "Average")]


def grad_shape(case, rank, n, mode):
    if case[0] == "allgather":
        return (gather_rows(rank, mode), 2)
    return (2 * n, 2) if case[0] == "reducescatter" else (3, 2)


def _sec_gradients(hvd, jax, jnp, n, mode):
    r, out = hvd.rank(), {}
    for case in GRAD_CASES:
        def loss(x, case=case):
            y = call_case(hvd, case, x, n)
            w = (jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape) + 1.0) * (r + 1)
            return jnp.sum(y * w)
        grad = jax.grad(loss)
        x = jnp.asarray(_values(("gx", case, r), "float32", grad_shape(case, r, n, mode)))
        out[case] = np.asarray((grad if mode == "eager" else jax.jit(grad))(x))
    return out


def _sec_process_set(hvd, jax, jnp, n):
    """Ranks 0 and n-1 (one rank when N = 1), eagerly and in jit; the others wait."""
    ps = hvd.add_process_set(sorted({0, n - 1}))
    r, out = hvd.rank(), {}
    if ps.included():
        def ops(x):
            return {"ar": hvd.allreduce(x, op=hvd.Sum, process_set=ps),
                    "ag": hvd.allgather(x, process_set=ps),
                    "bc": hvd.broadcast(x, root_rank=n - 1, process_set=ps)}
        x = jnp.asarray(_values(("ps", r), "float32", (2, 2)))
        out = {"eager": {k: np.asarray(v) for k, v in ops(x).items()},
               "jit": {k: np.asarray(v) for k, v in jax.jit(ops)(x).items()}}
    hvd.remove_process_set(ps)
    return out


def _sec_nonmember(hvd, jax, jnp, n):
    """Collectives on a set of rank 0 alone: on every other rank each raises ValueError from
    its own check (Horovod's invalid argument); rank 0 runs its own."""
    ps = hvd.add_process_set([0])
    x = jnp.ones(2)
    calls = {"allreduce": lambda: hvd.allreduce(x, process_set=ps),
             "allgather": lambda: hvd.allgather(x, process_set=ps),
             "broadcast": lambda: hvd.broadcast(x, 0, process_set=ps),
             "alltoall": lambda: hvd.alltoall(x, process_set=ps)}
    out = {kind: _caught(call) for kind, call in calls.items()}
    hvd.barrier()
    hvd.remove_process_set(ps)
    return out


def _sec_errors(hvd, jax, jnp, n):
    """A shape mismatch (eagerly and in jit) and a bad argument on rank 0 only."""
    out = {}
    r = hvd.rank()
    for mode in MODES:
        fn = (lambda x: hvd.allreduce(x, name=f"mismatched.{mode}"))
        try:
            y = (fn if mode == "eager" else jax.jit(fn))(jnp.ones(2 + r))
            np.asarray(y)
            out[mode] = None
        except Exception as e:  # noqa: BLE001 - the test checks the type
            out[mode] = ([c.__name__ for c in type(e).__mro__], str(e))
    try:                            # rows that differ by rank, where jit fixed the shape
        np.asarray(jax.jit(hvd.allgather)(jnp.ones((1 + r, 2))))
        out["rows"] = None
    except Exception as e:  # noqa: BLE001
        out["rows"] = str(e)
    try:
        hvd.allreduce(jnp.ones(2), op=99 if r == 0 else hvd.Sum)
        out["bad"] = None
    except Exception as e:  # noqa: BLE001
        out["bad"] = ([c.__name__ for c in type(e).__mro__], str(e))
    out["after"] = np.asarray(hvd.allreduce(jnp.asarray([float(r)]), op=hvd.Sum))
    return out


def _sec_names(hvd, jax, jnp, n):
    """Functions traced on rank 0 only (``lower`` traces without running) shift no name:
    unnamed collectives are counted per trace, so every rank's trace of ``f`` agrees."""
    r = hvd.rank()
    f = jax.jit(lambda x: hvd.allreduce(x, op=hvd.Sum) * 2)
    g = jax.jit(lambda x: hvd.allgather(x))
    if r == 0:
        g.lower(jnp.ones(3))
        f.lower(jnp.ones(5))
    return [np.asarray(f(jnp.full(2, float(r)))) for _ in range(2)]


def _sec_misc(hvd, jax, jnp, n):
    r = hvd.rank()
    h = hvd.allreduce_async(jnp.asarray([r, 1], jnp.int32), op=hvd.Sum)
    g = hvd.allgather_async(jnp.full((1, 2), r, jnp.bfloat16))
    jax.jit(lambda: hvd.barrier())()
    return {"async": np.asarray(hvd.synchronize(h)), "poll": hvd.poll(h),
            "async_ag": (str(hvd.synchronize(g).dtype), np.asarray(hvd.synchronize(g),
                                                                  np.float32)),
            "join": int(hvd.join()), "barrier": hvd.barrier(),
            "object": hvd.broadcast_object({"from": r}, root_rank=n - 1),
            "objects": hvd.allgather_object(r)}


def _worker(n):
    import jax
    import jax.numpy as jnp

    import hora.jax as hvd
    sections = {
        "info": lambda: (hvd.rank(), hvd.size()),
        **{f"ops_{m}": (lambda m=m: _sec_ops(hvd, jax, jnp, n, m)) for m in MODES},
        **{f"grad_{m}": (lambda m=m: _sec_gradients(hvd, jax, jnp, n, m)) for m in MODES},
        "process_set": lambda: _sec_process_set(hvd, jax, jnp, n),
        "nonmember": lambda: _sec_nonmember(hvd, jax, jnp, n),
        "errors": lambda: _sec_errors(hvd, jax, jnp, n),
        "names": lambda: _sec_names(hvd, jax, jnp, n),
        "misc": lambda: _sec_misc(hvd, jax, jnp, n),
    }
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, run in sections.items():
            try:
                out[name] = ("ok", run())
            except Exception:
                out[name] = ("error", traceback.format_exc())
    out["warnings"] = ("ok", [f"{w.category.__name__}: {w.message}" for w in caught])
    return out


# one thread per rank for XLA: three ranks on two CPUs
_ENV = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
        "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2"}
job = job_fixture(_worker, env_for=lambda n: _ENV, timeout_s=90)
pytestmark = pytest.mark.timeout(120)


# -- the tests -------------------------------------------------------------------------------
def assert_array(got, exp, what):
    dtype, arr = got
    staged = dtype == "bfloat16" and exp.dtype == np.float32
    assert staged or dtype == exp.dtype.name, f"{what}: dtype {dtype}, expected {exp.dtype}"
    assert arr.shape == exp.shape, f"{what}: shape {arr.shape}, expected {exp.shape}"
    if dtype in _TOL:
        np.testing.assert_allclose(arr.astype(np.float64), exp.astype(np.float64),
                                   rtol=_TOL[dtype], atol=_TOL[dtype], err_msg=what)
    else:
        np.testing.assert_array_equal(arr, exp, err_msg=what)


@pytest.mark.parametrize("n", SIZES)
def test_job_runs_every_section_without_warnings(job, n):
    assert section(job(n), "info") == [(r, n) for r in range(n)]
    for r, caught in enumerate(section(job(n), "warnings")):
        assert caught == [], f"rank {r} warned: {caught}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", SIZES)
def test_allreduce_every_dtype_op_and_pytree(job, n, mode):
    per_rank = section(job(n), f"ops_{mode}")
    for case in allreduce_cases():
        dt, op, shape, pre, post = case
        exp = reduce_expected([_values(("ar", case, k), dt, shape) for k in range(n)], op,
                              pre, post)
        for r in range(n):
            assert per_rank[r]["ar", case][0] == dt, f"{mode} allreduce {case}: dtype"
            assert_array(per_rank[r]["ar", case], exp, f"{mode} n={n} allreduce {case} r{r}")
    for r in range(n):
        res = per_rank[r]
        exp = reduce_expected([_values(("dflt", k), "float32", (4,)) for k in range(n)],
                              "Average")
        assert_array(res["ar", "default"], exp, f"{mode} default op is Average")
        exp = reduce_expected([_values(("avg", k), "int32", (4,)) for k in range(n)], "Sum")
        assert_array(res["ar", "average=False"], exp, f"{mode} average=False")
        for j, dt in enumerate(["float32", "int32", "bfloat16"]):
            exp = reduce_expected([_values(("gar", j, k), dt, (2, j + 1)) for k in range(n)],
                                  "Sum")
            assert res["gar", j][0] == dt
            assert_array(res["gar", j], exp, f"{mode} grouped_allreduce {j}")
        for leaf, dt, shape in [("a", "float32", (3,)), ("b", "int8", (2, 2))]:
            exp = reduce_expected([_values(("tree", leaf, k), dt, shape) for k in range(n)],
                                  "Sum")
            assert_array(res["tree", leaf], exp, f"{mode} pytree leaf {leaf}")
        exp = reduce_expected([_values(("fp16", k), "float32", (6,)) for k in range(n)], "Sum")
        assert_array(res["fp16", "float32"], exp, "fp16 compression keeps float32")
        exp = reduce_expected([_values(("fp16i", k), "int32", (6,)) for k in range(n)], "Sum")
        assert_array(res["fp16", "int32"], exp, "fp16 compression leaves int32 alone")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", SIZES)
def test_allgather_broadcast_alltoall_reducescatter(job, n, mode):
    per_rank = section(job(n), f"ops_{mode}")
    for r in range(n):
        res = per_rank[r]
        for dt in DTYPES:
            exp = np.concatenate([_values(("ag", dt, k), dt, (gather_rows(k, mode), 2))
                                  for k in range(n)])
            assert_array(res["ag", dt], exp, f"{mode} allgather {dt} rank {r}")
            assert_array(res["bc", dt], _values(("bc", dt, n - 1), dt, (2, 3)),
                         f"{mode} broadcast {dt} rank {r}")
        for j in range(2):
            exp = np.concatenate([_values(("gag", j, k), "float32", (gather_rows(k, mode), j + 1))
                                  for k in range(n)])
            assert_array(res["gag", j], exp, f"{mode} grouped_allgather {j}")
        if mode == "eager":
            splits = [alltoall_splits(k, n) for k in range(n)]
            xs = [_values(("a2a", k), "float32", (sum(splits[k]), 2)) for k in range(n)]
            starts = [np.cumsum([0] + s).tolist() for s in splits]
            exp = np.concatenate([x[s[r]:s[r + 1]] for x, s in zip(xs, starts)])
            assert_array(res["a2a", "splits"], exp, f"alltoall with splits rank {r}")
            assert_array(res["a2a", "received"], np.array([s[r] for s in splits], np.int32),
                         "alltoall received splits")
        exp = np.concatenate([_values(("a2a-even", k), "bfloat16", (2 * n,))[2 * r:2 * r + 2]
                              for k in range(n)])
        assert_array(res["a2a", "even"], exp, f"{mode} alltoall without splits")
        lo, hi = block_bounds(2 * n + 1, n)[r:r + 2]
        for dt, op in [("float32", "Sum"), ("float32", "Average"), ("int32", "Sum")]:
            full = reduce_expected([_values(("rs", dt, op, k), dt, (2 * n + 1, 2))
                                    for k in range(n)], op)
            assert_array(res["rs", dt, op], full[lo:hi], f"{mode} reducescatter {dt} {op}")
        for j in range(2):
            full = reduce_expected([_values(("grs", j, k), "float32", (n + j, 2))
                                    for k in range(n)], "Sum")
            b = block_bounds(n + j, n)
            assert_array(res["grs", j], full[b[r]:b[r + 1]], f"{mode} grouped_reducescatter")


def grad_expected(case, n, r, mode):
    kind, op = case
    xs = [_values(("gx", case, k), "float32", grad_shape(case, k, n, mode)) for k in range(n)]
    if kind == "allgather":
        out_rows = [sum(x.shape[0] for x in xs)] * n
    elif kind == "reducescatter":
        out_rows = list(np.diff(block_bounds(2 * n, n)))
    else:
        out_rows = [x.shape[0] for x in xs]
    ws = [(np.arange(out_rows[k] * 2).reshape(out_rows[k], 2) + 1.0) * (k + 1)
          for k in range(n)]
    if kind in ("allreduce", "grouped_allreduce"):
        factor = 2.0 if kind == "grouped_allreduce" else 1.0   # the output used is of 2 * x
        return sum(ws) / (n if op == "Average" else 1) * factor
    if kind == "allgather":
        start = sum(x.shape[0] for x in xs[:r])
        return (sum(ws) / n)[start:start + xs[r].shape[0]]
    if kind == "broadcast":
        return sum(ws) / n if r == n - 1 else np.zeros_like(xs[r])
    return np.concatenate(ws) * (n if op == "Sum" else 1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", SIZES)
def test_gradients_match_horovods_definitions(job, n, mode):
    per_rank = section(job(n), f"grad_{mode}")
    for r in range(n):
        for case in GRAD_CASES:
            np.testing.assert_allclose(per_rank[r][case], grad_expected(case, n, r, mode),
                                       rtol=1e-6, atol=1e-6,
                                       err_msg=f"{mode} n={n} gradient of {case} rank {r}")


@pytest.mark.parametrize("n", SIZES)
def test_process_set(job, n):
    members = sorted({0, n - 1})
    xs = [_values(("ps", k), "float32", (2, 2)) for k in members]
    for r, res in enumerate(section(job(n), "process_set")):
        if r not in members:
            assert res == {}
            continue
        for mode in MODES:
            np.testing.assert_allclose(res[mode]["ar"], sum(xs), err_msg=f"{mode} allreduce")
            np.testing.assert_allclose(res[mode]["ag"], np.concatenate(xs),
                                       err_msg=f"{mode} allgather")
            np.testing.assert_allclose(res[mode]["bc"], xs[-1], err_msg=f"{mode} broadcast")


@pytest.mark.parametrize("n", SIZES)
def test_collectives_on_a_set_without_this_rank_raise_value_error(job, n):
    members, *others = section(job(n), "nonmember")
    for r, other in enumerate(others, start=1):
        for kind, caught in other.items():
            assert caught is not None and caught[1] and "not a member" in caught[3], \
                (r, kind, caught)
    assert all(caught is None for caught in members.values()), members


@pytest.mark.parametrize("n", SIZES)
def test_mismatch_and_bad_argument_raise_on_every_rank(job, n):
    for r, res in enumerate(section(job(n), "errors")):
        mro, message = res["eager"]
        assert "CollectiveMismatchError" in mro and "RuntimeError" in mro, mro
        assert "mismatched.eager" in message and "shape" in message, message
        mro, message = res["jit"]                       # JAX's runtime error, hora's text
        assert "CollectiveMismatchError" in message and "mismatched.jit" in message, message
        assert "CollectiveMismatchError" in res["rows"] and "same number of rows" in res["rows"]
        mro, message = res["bad"]
        if r == 0:
            assert mro[0] == "ValueError" and "99" in message, (mro, message)
        else:
            assert "CollectiveAbortedError" in mro and "rank 0" in message, (mro, message)
        assert res["after"].tolist() == [n * (n - 1) / 2], "the automatic names fell apart"


@pytest.mark.parametrize("n", SIZES)
def test_names_in_jit_survive_a_trace_on_one_rank(job, n):
    for r, res in enumerate(section(job(n), "names")):
        assert [y.tolist() for y in res] == [[n * (n - 1)] * 2] * 2, (r, res)


@pytest.mark.parametrize("n", SIZES)
def test_async_join_barrier_objects(job, n):
    for r, res in enumerate(section(job(n), "misc")):
        assert res["async"].tolist() == [n * (n - 1) // 2, n] and res["poll"]
        dtype, gathered = res["async_ag"]
        assert dtype == "bfloat16" and gathered.tolist() == [[k, k] for k in range(n)]
        assert 0 <= res["join"] < n and res["barrier"] is None
        assert res["object"] == {"from": n - 1} and res["objects"] == list(range(n))
