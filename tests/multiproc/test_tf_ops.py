"""``hora.tensorflow``'s collectives on real processes, checked against NumPy on the gathered
inputs.

One job of 3 ranks runs every section (tests/multiproc/tf_ops_job.py: each op eagerly and
inside one ``tf.function``, gradients by ``tf.GradientTape`` both ways, compression,
IndexedSlices, join, a shape mismatch, a bad argument on one rank, the XLA refusal) and
returns plain NumPy values; the tests below check one section each.  N = 3 is the
transport's every path: a ring whose two neighbours differ, an odd N (uneven reducescatter
blocks, a rank that sends no rows to an allgather), and a process set a rank is not in.
The binding has no branch on N, so other N would run its same code: N = 2 checks nothing
N = 3 does not, and N = 1's own paths are the core's (a one-rank job settles every call
alone), which test_collectives.py checks for every collective at N = 1, and which
test_tf_training.py's one-rank job takes through TensorFlow.

The job then runs the sections of where Horovod's own TensorFlow tests found hora
differing (issue 60): uint16 through every collective, ``tf.errors`` types from inside a
graph, process-set ops and errors, the ``tf.compat.v1`` ``DistributedOptimizer`` with
``backward_passes_per_step``, a Keras optimizer handed to
``hora.tensorflow.DistributedOptimizer`` (the ``compat`` tests at the end).  TensorFlow is
imported by the workers only (its import costs seconds per process, and may warn).
"""
import ast
import importlib.util
import traceback
import warnings

import numpy as np
import pytest

from tests.helpers import TF_EXTRAS, job_fixture, run_sections, section, without

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("TensorFlow is not installed (pip install 'hora[tensorflow]')",
                allow_module_level=True)

from tests.multiproc import tf_ops_job  # noqa: E402
from tests.helpers import block_bounds, reduce_expected  # noqa: E402
from tests.multiproc.tf_ops_job import (  # noqa: E402
    COMPAT_N, DTYPES, EVEN, GRAD_CASES, HOROVOD, MODES, ODD, TOL, allgather_rows,
    allreduce_cases, alltoall_splits, compat_values, grad_shape, values)

SIZES = [3]


def _worker(n):
    import tensorflow as tf

    import hora.tensorflow as hvd
    sections = tf_ops_job.sections(hvd, tf, n)
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, run in sections.items():
            try:
                out[name] = ("ok", run())
            except Exception:
                out[name] = ("error", traceback.format_exc())
    out["warnings"] = ("ok", [f"{w.category.__name__}: {w.message}" for w in caught])
    if n == COMPAT_N:
        out.update(run_sections(tf_ops_job.compat_sections(hvd, tf)))
        hvd.barrier()
    return out


# TensorFlow's start-up log lines, off (oneDNN's comes before its log level is read)
_QUIET = without(TF_EXTRAS, {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0"})
# three TensorFlow processes on two CPUs: about 60 s, the compat sections included; the bound
# is the sum of the bounds of the two jobs it replaces (every section's 150 s, compat's 120 s)
job = job_fixture(_worker, env_for=lambda n: _QUIET, timeout_s=270)
pytestmark = pytest.mark.timeout(300)


# -- the tests -------------------------------------------------------------------------------
def assert_array(got, exp, what):
    dtype, arr = got
    staged = dtype == "bfloat16" and exp.dtype == np.float64    # the oracle has no bfloat16
    assert staged or dtype == exp.dtype.name, f"{what}: dtype {dtype}, expected {exp.dtype}"
    assert arr.shape == exp.shape, f"{what}: shape {arr.shape}, expected {exp.shape}"
    if dtype in TOL:
        np.testing.assert_allclose(arr.astype(np.float64), exp.astype(np.float64),
                                   rtol=TOL[dtype], atol=TOL[dtype], err_msg=what)
    else:
        np.testing.assert_array_equal(arr, exp, err_msg=what)


@pytest.mark.parametrize("n", SIZES)
def test_job_runs_every_section_without_warnings(job, n):
    """The first test per N: its duration is the whole job's."""
    assert section(job(n), "info") == [(r, n) for r in range(n)]
    for r, caught in enumerate(section(job(n), "warnings")):
        assert caught == [], f"rank {r} warned: {caught}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", SIZES)
def test_allreduce_every_dtype_and_op(job, n, mode):
    per_rank = section(job(n), f"ops_{mode}")
    for case in allreduce_cases():
        dt, op, shape, pre, post = case
        exp = reduce_expected([values(("ar", case, k), dt, shape) for k in range(n)], op,
                              pre, post)
        for r in range(n):
            got = per_rank[r]["ar", case]
            assert got[0] == dt, f"{mode} allreduce {case}: dtype {got[0]}"
            assert_array(got, exp, f"{mode} n={n} allreduce {case} rank {r}")
    for r in range(n):
        exp = reduce_expected([values(("avg", k), "int32", (4,)) for k in range(n)], "Sum")
        assert_array(per_rank[r]["ar", "average=False"], exp, f"{mode} average=False")
        exp = reduce_expected([values(("dflt", k), "float64", (4,)) for k in range(n)],
                              "Average")
        assert_array(per_rank[r]["ar", "default"], exp, f"{mode} default op is Average")
        for j, dt in enumerate(["float32", "int32", "bfloat16"]):
            exp = reduce_expected([values(("gar", j, k), dt, (2, j + 1)) for k in range(n)],
                                  "Sum")
            assert per_rank[r]["gar", j][0] == dt
            assert_array(per_rank[r]["gar", j], exp, f"{mode} grouped_allreduce {j}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", SIZES)
def test_allgather_broadcast_alltoall_reducescatter(job, n, mode):
    per_rank = section(job(n), f"ops_{mode}")
    for r in range(n):
        res = per_rank[r]
        for dt in DTYPES:
            exp = np.concatenate([values(("ag", dt, k), dt, (allgather_rows(k), 2))
                                  for k in range(n)])
            assert res["ag", dt][0] == dt
            assert_array(res["ag", dt], exp, f"{mode} allgather {dt} rank {r}")
            exp = values(("bc", dt, n - 1), dt, (2, 3))
            assert_array(res["bc", dt], exp, f"{mode} broadcast {dt} rank {r}")
        for j in range(2):
            exp = np.concatenate([values(("gag", j, k), "float32", (allgather_rows(k), j))
                                  for k in range(n)])
            assert_array(res["gag", j], exp, f"{mode} grouped_allgather {j}")
        for dt in ("float32", "int64", "bfloat16"):
            splits = [alltoall_splits(dt, k, n) for k in range(n)]
            xs = [values(("a2a", dt, k), dt, (sum(splits[k]), 2)) for k in range(n)]
            starts = [np.cumsum([0] + s).tolist() for s in splits]
            exp = np.concatenate([x[s[r]:s[r + 1]] for x, s in zip(xs, starts)])
            assert_array(res["a2a", dt], exp, f"{mode} alltoall {dt} rank {r}")
            assert_array(res["a2a-splits", dt], np.array([s[r] for s in splits], np.int32),
                         f"{mode} alltoall received splits")
        exp = np.concatenate([values(("a2a-even", k), "float64", (2 * n,))[2 * r:2 * r + 2]
                              for k in range(n)])
        assert_array(res["a2a", "even"], exp, f"{mode} alltoall without splits")
        lo, hi = block_bounds(2 * n + 1, n)[r:r + 2]
        for dt, op in [("float32", "Sum"), ("float64", "Average"), ("int32", "Sum")]:
            full = reduce_expected([values(("rs", dt, op, k), dt, (2 * n + 1, 2))
                                    for k in range(n)], op)
            assert_array(res["rs", dt, op], full[lo:hi], f"{mode} reducescatter {dt} {op}")
        for j in range(2):
            full = reduce_expected([values(("grs", j, k), "float32", (n + j, 2))
                                    for k in range(n)], "Sum")
            b = block_bounds(n + j, n)
            assert_array(res["grs", j], full[b[r]:b[r + 1]], f"{mode} grouped_reducescatter")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", SIZES)
def test_compression_and_indexed_slices(job, n, mode):
    per_rank = section(job(n), f"ops_{mode}")
    for r in range(n):
        res = per_rank[r]
        exp = reduce_expected([values(("fp16", k), "float32", (6,)) for k in range(n)], "Sum")
        assert_array(res["fp16", "float32"], exp, "fp16 compression keeps float32")
        exp = reduce_expected([values(("fp16i", k), "int32", (6,)) for k in range(n)], "Sum")
        assert_array(res["fp16", "int32"], exp, "fp16 compression leaves int32 alone")
        for op in ("Sum", "Average"):
            kind, gathered, indices = res["is", op]
            assert kind == "IndexedSlices"
            exp = np.concatenate([values(("is", op, k), "float32", (k + 1, 3))
                                  for k in range(n)])
            assert_array(gathered, exp / (n if op == "Average" else 1), f"IndexedSlices {op}")
            assert_array(indices, np.concatenate([np.arange(k + 1) for k in range(n)]),
                         "IndexedSlices indices")


def grad_expected(case, n, r):
    """Horovod's gradient of sum(w_r * op(x)) for rank r, w_k = (1 + arange) * (k + 1)."""
    kind, op = case
    xs = [values(("gx", case, k), "float64", grad_shape(case, k, n)) for k in range(n)]
    if kind == "alltoall":
        splits = [alltoall_splits("grad", k, n) for k in range(n)]
        out_rows = [sum(s[k] for s in splits) for k in range(n)]
    elif "allgather" in kind:
        out_rows = [sum(x.shape[0] for x in xs)] * n
    elif "reducescatter" in kind:
        out_rows = [np.diff(block_bounds(2 * n + 1, n))[k] for k in range(n)]
    else:
        out_rows = [xs[k].shape[0] for k in range(n)]
    ws = [(np.arange(out_rows[k] * 2).reshape(out_rows[k], 2) + 1.0) * (k + 1)
          for k in range(n)]
    factor = 2.0 if kind == "grouped_allreduce" else 1.0     # the output used is of 2 * x
    if kind in ("allreduce", "grouped_allreduce"):
        red = sum(ws) / (n if op == "Average" else 1)
        return red * factor
    if "allgather" in kind:
        mean = sum(ws) / n
        start = sum(x.shape[0] for x in xs[:r])
        return mean[start:start + xs[r].shape[0]] * (2.0 if kind == "grouped_allgather" else 1)
    if kind == "broadcast":
        return sum(ws) / n if r == n - 1 else np.zeros_like(xs[r])
    if kind == "alltoall":
        # rank r's rows sent to rank j come back from w_j, at their place in j's output
        parts = []
        for j in range(n):
            offset = sum(alltoall_splits("grad", k, n)[j] for k in range(r))
            parts.append(ws[j][offset:offset + splits[r][j]])
        return np.concatenate(parts)
    scale = n if op == "Sum" else 1
    return np.concatenate(ws) * scale


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", SIZES)
def test_gradients_match_horovods_definitions(job, n, mode):
    per_rank = section(job(n), f"grad_{mode}")
    for r in range(n):
        for case in GRAD_CASES:
            grad, _ = per_rank[r][case]
            exp = grad_expected(case, n, r)
            np.testing.assert_allclose(grad, exp, rtol=1e-12, atol=1e-12,
                                       err_msg=f"{mode} n={n} gradient of {case} rank {r}")


@pytest.mark.parametrize("n", [3])
def test_mismatch_raises_on_every_rank_with_horas_message(job, n):
    for r, res in enumerate(section(job(n), "mismatch")):
        mro, is_tf, message = res["eager"]
        assert "CollectiveMismatchError" in mro and "RuntimeError" in mro and is_tf, mro
        assert "mismatched" in message and "shape" in message, message
        mro, message = res["graph"]
        assert "FailedPreconditionError" in mro and "CollectiveMismatchError" in mro, mro
        assert "HorovodAllgather" in message, message
        tf_ops_job.assert_refused_on_rank0(res["bad"], r, "complex64")
        assert res["after"].tolist() == [n * (n - 1) / 2], "the automatic names fell apart"


@pytest.mark.parametrize("n", [3])
def test_alltoall_arguments_raise_invalid_argument_error(job, n):
    """(At N = 1 every row count divides among the ranks.)"""
    for r, caught in enumerate(section(job(n), "alltoall_arguments")):
        assert caught == {"uneven": "InvalidArgumentError", "sum": "InvalidArgumentError"}, \
            (r, caught)


@pytest.mark.parametrize("n", SIZES)
def test_xla_is_refused_at_once(job, n):
    for res in section(job(n), "xla"):
        assert res is not None, "a collective compiled under jit_compile=True"
        kind, message, seconds = res
        assert kind == "NotImplementedError" and "jit_compile" in message, res
        assert seconds < 20, f"the refusal took {seconds:.1f} s"


@pytest.mark.parametrize("n", SIZES)
def test_join_topology_ops_and_objects(job, n):
    for r, res in enumerate(section(job(n), "misc")):
        assert 0 <= res["join"] < n and res["rank_op"] == r and res["size_op"] == n
        assert res["barrier"] is None
        assert res["object"] == {"from": n - 1} and res["objects"] == list(range(n))


def _spec(spec):
    """[(parameter, default as source text, or None)] of a Horovod signature."""
    args = ast.parse(f"def f({spec}): pass").body[0].args
    defaults = [None] * (len(args.args) - len(args.defaults)) + list(args.defaults)
    out = []
    for a, d in zip(args.args, defaults):
        if isinstance(d, ast.Constant):
            out.append((a.arg, repr(d.value)))
        else:
            out.append((a.arg, None if d is None else ast.unparse(d)))
    return out


def test_collectives_have_horovods_signatures(job):
    got = section(job(3), "signatures")[0]
    for name, spec in HOROVOD.items():
        want = _spec(spec)
        assert got[name][:len(want)] == want, f"{name}: {got[name]} != Horovod's {want}"
        extra = got[name][len(want):]
        assert all(d is not None for _, d in extra), f"{name}: hora's extra {extra} need defaults"


@pytest.mark.parametrize("n", SIZES)
def test_process_set(job, n):
    members = sorted({0, n - 1})
    xs = [values(("ps", k), "float32", (2 * len(members), 2)) for k in members]
    total = sum(xs)
    for r, res in enumerate(section(job(n), "process_set")):
        if r not in members:
            assert res == {}
            continue
        i = members.index(r)
        for mode in MODES:
            got = res[mode]
            np.testing.assert_allclose(got["ar"], total, err_msg=f"{mode} allreduce")
            np.testing.assert_allclose(got["ag"], np.concatenate(xs), err_msg=f"{mode} allgather")
            np.testing.assert_allclose(got["bc"], xs[-1], err_msg=f"{mode} broadcast")
            np.testing.assert_allclose(got["rs"], total[2 * i:2 * i + 2],
                                       err_msg=f"{mode} reducescatter")


# -- where Horovod's own tests found hora differing: the N = 3 job's compat sections ---------
def test_compat_uint16_through_every_collective(job):
    n = COMPAT_N
    xs = [compat_values(("x", r), "uint16", (n, 2)) for r in range(n)]
    total = sum(x.astype(np.int64) for x in xs).astype(np.uint16)
    for r, res in enumerate(section(job(n), "compat_dtypes")):
        expected = {"ar": total, "gar": np.maximum.reduce(xs), "ag": np.concatenate(xs),
                    "gag": np.concatenate(xs), "bc": xs[2],
                    "a2a": np.stack([x[r] for x in xs]), "rs": total[r:r + 1],
                    "grs": total[r:r + 1]}
        for mode in ("eager", "graph"):
            for k, exp in expected.items():
                got = res[mode][k]
                assert got.dtype == np.uint16, (mode, k, got.dtype)
                np.testing.assert_array_equal(got, exp, err_msg=f"{mode} {k}")
        for k in ("ar", "ag", "bc"):
            assert res["numpy"][k].dtype == np.uint16
            np.testing.assert_array_equal(res["numpy"][k], expected[k], err_msg=f"numpy {k}")


def test_compat_graph_errors_are_tensorflows_types_with_horas_message(job):
    for r, res in enumerate(section(job(COMPAT_N), "compat_graph_errors")):
        for case, name in (("shape", "sh"), ("dtype", "dt"), ("root", "rt"),
                           ("session", "v1")):
            assert res[case] is not None, f"{case}: nothing raised on rank {r}"
            mro, message = res[case]
            assert "FailedPreconditionError" in mro and "CollectiveMismatchError" in mro, \
                (case, mro)
            assert repr(name) in message, (case, message)
        assert "shape" in res["shape"][1] and "rank" in res["shape"][1], res["shape"]
        assert res["after"] == COMPAT_N


def test_compat_process_set_ops_and_membership_errors(job):
    for r, res in enumerate(section(job(COMPAT_N), "compat_process_sets")):
        member = r in EVEN
        assert res["topology"] == [2, int(member), EVEN.index(r) if member else -4, -3,
                                   COMPAT_N]
        assert res["eager_included"] == int(r in ODD)
        for what in ("foreign_eager", "unknown"):
            mro, message = res[what]
            assert "InvalidArgumentError" in mro and "ValueError" in mro, (what, mro)
        assert "not a member" in res["foreign_eager"][1], res["foreign_eager"]
        concrete, ran = res["foreign_graph"]
        assert concrete is None, f"tracing on a non-member raised: {concrete}"
        assert "InvalidArgumentError" in ran[0] and "not a member" in ran[1], ran


def test_compat_reducescatter_gradient_on_a_process_set_in_float16(job):
    results = section(job(COMPAT_N), "compat_process_sets")
    for members in (EVEN, ODD):
        for op in ("Sum", "Average"):
            dys = [compat_values(("dy", op, r), "float32", (4, 2)) for r in members]
            expected = np.concatenate(dys) * (len(members) if op == "Sum" else 1)
            for r in members:
                dtype, got = results[r]["rs_grad"][op]
                assert dtype == "float16"
                np.testing.assert_array_equal(got, expected, err_msg=f"rank {r} {op}")


def _expected_steps(contribution, steps, average, runs=6):
    """The variable after each run: the round's reduced sum added on its last step."""
    value, out = 0.0, []
    for k in range(1, runs + 1):
        if k % steps == 0:
            value += contribution * steps / (steps if average else 1)
        out.append(value)
    return out


def test_compat_v1_optimizer_aggregates_backward_passes_and_reduces_on_a_set(job):
    squares = [r ** 2 for r in range(COMPAT_N)]
    mean = sum(squares) / COMPAT_N
    for r, res in enumerate(section(job(COMPAT_N), "compat_optimizers")):
        values, steps = res["bpps3_avg"]
        assert values == pytest.approx(_expected_steps(mean, 3, True)), values
        assert steps == list(range(1, 7)), steps
        values, _ = res["bpps2_sum_sparse"]
        assert values == pytest.approx(_expected_steps(mean, 2, False)), values
        values, _ = res["even_set"]
        # outside the set, its own gradient
        own = np.mean([squares[k] for k in EVEN]) if r in EVEN else squares[r]
        assert values == pytest.approx([own * k for k in range(1, 7)]), values
        mro, message = res["eager_bpps"]
        assert "ValueError" in mro and "graph" in message, res["eager_bpps"]
        assert res["keras"] is True
        assert res["util"] == (True, True)
