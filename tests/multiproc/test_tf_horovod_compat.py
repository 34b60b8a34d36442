"""``hora.tensorflow`` where Horovod's own TensorFlow tests found it differing (issue 60): every
dtype Horovod's ops take (uint16), ``tf.errors`` types from inside a graph, process-set ops
and errors, the ``tf.compat.v1`` ``DistributedOptimizer`` with ``backward_passes_per_step``,
a Keras optimizer handed to ``hora.tensorflow.DistributedOptimizer``.

One job of 3 ranks (process sets: ranks {0, 2} and {1}) runs every section and returns plain
values; each test checks one section, against NumPy on the inputs this process rebuilds from
(case, rank).  TensorFlow is imported by the workers only.
"""
import importlib.util
import zlib

import numpy as np
import pytest

from tests.helpers import TF_EXTRAS, job_fixture, section, without

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("TensorFlow is not installed (pip install 'hora[tensorflow]')",
                allow_module_level=True)

N = 3
EVEN, ODD = [0, 2], [1]


def _values(key, dtype, shape):
    """Small non-negative integers (exact in every dtype, and in sums of 3 of them)."""
    rng = np.random.default_rng([20261204, zlib.crc32(repr(key).encode())])
    return rng.integers(0, 9, size=shape).astype(dtype)


# -- the worker's sections -------------------------------------------------------------------
def _sec_dtypes(hvd, tf):
    """uint16 through every collective, eagerly and in one tf.function, and hora's NumPy API."""
    import hora
    r = hvd.rank()

    def ops():
        x = tf.constant(_values(("x", r), "uint16", (N, 2)))
        return {"ar": hvd.allreduce(x, op=hvd.Sum),
                "gar": hvd.grouped_allreduce([x, x], op=hvd.Max)[1],
                "ag": hvd.allgather(x), "gag": hvd.grouped_allgather([x])[0],
                "bc": hvd.broadcast(x, root_rank=2), "a2a": hvd.alltoall(x),
                "rs": hvd.reducescatter(x, op=hvd.Sum),
                "grs": hvd.grouped_reducescatter([x], op=hvd.Sum)[0]}
    out = {"eager": {k: v.numpy() for k, v in ops().items()}}
    keys = sorted(out["eager"])
    f = tf.function(lambda: [ops()[k] for k in keys])
    out["graph"] = {k: v.numpy() for k, v in zip(keys, f())}
    a = _values(("x", r), "uint16", (N, 2))
    out["numpy"] = {"ar": hora.allreduce(a, op=hora.Sum), "ag": hora.allgather(a),
                    "bc": hora.broadcast(a, root_rank=2)}
    return out


def _caught(fn):
    """What ``fn()`` raised: (class names of its type, message), or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the tests check the type
        return [c.__name__ for c in type(e).__mro__], str(e)
    return None


def _sec_graph_errors(hvd, tf):
    """Mismatched shape, dtype and root inside tf.function and a tf.compat.v1 session."""
    r = hvd.rank()
    out = {
        "shape": _caught(tf.function(lambda: hvd.allreduce(tf.ones([2 + r]), name="sh"))),
        "dtype": _caught(tf.function(lambda: hvd.allgather(
            tf.ones([2], tf.float32 if r else tf.float64), name="dt"))),
        "root": _caught(tf.function(lambda: hvd.broadcast(tf.ones([2]), root_rank=r,
                                                          name="rt"))),
    }
    with tf.Graph().as_default():
        y = hvd.allreduce(tf.ones([1 + r]), name="v1")
        with tf.compat.v1.Session() as session:
            out["session"] = _caught(lambda: session.run(y))
    # the job goes on: the names are still in step
    out["after"] = float(tf.function(lambda: hvd.allreduce(tf.ones([1]), op=hvd.Sum))()[0])
    return out


def _sec_process_sets(hvd, tf, even, odd):
    r = hvd.rank()
    mine, other = (even, odd) if r in EVEN else (odd, even)
    ops = tf.function(lambda: [hvd.size_op(process_set_id=even.process_set_id),
                               hvd.process_set_included_op(process_set_id=even.process_set_id),
                               hvd.rank_op(process_set_id=even.process_set_id),
                               hvd.size_op(process_set_id=99), hvd.size_op()])
    out = {"topology": [int(t) for t in ops()],
           "eager_included": int(hvd.process_set_included_op(odd.process_set_id))}
    x = tf.ones([4])
    out["foreign_eager"] = _caught(lambda: hvd.allreduce(x, process_set=other))
    # traced on a non-member, it raises when it runs, not when it is traced
    traced = tf.function(lambda: hvd.allgather(x, process_set=other))
    concrete = _caught(lambda: traced.get_concrete_function())
    out["foreign_graph"] = (concrete, _caught(traced))
    fake = hvd.ProcessSet([0, 1, 2])
    fake.process_set_id = 10
    out["unknown"] = _caught(lambda: hvd.allreduce(x, process_set=fake))
    # the reducescatter gradient on a set, float16 (Horovod's test_..._grad_cpu_process_sets)
    grads = {}
    for op in ("Sum", "Average"):
        v = tf.Variable(tf.cast(_values(("rsg", r), "float32", (mine.size() * 4, 2)),
                                tf.float16))
        with tf.GradientTape() as tape:
            y = hvd.reducescatter(v, op=getattr(hvd, op), process_set=mine)
        dy = tf.cast(tf.constant(_values(("dy", op, r), "float32", (4, 2))), tf.float16)
        g = tape.gradient(tf.cast(y, v.dtype), v, dy)
        grads[op] = (g.dtype.name, g.numpy().astype(np.float64))
    out["rs_grad"] = grads
    return out


def _v1_optimizer_job(hvd, tf, steps, average, process_set, sparse=False):
    """Horovod's legacy-optimizer check: a variable that adds its gradient (this rank's
    number, squared) each applied step; returns its value and the global step after every run."""
    values, global_steps = [], []
    with tf.Graph().as_default():
        class AddGradient(tf.compat.v1.train.Optimizer):
            def __init__(self):
                super().__init__(use_locking=False, name="add")
                self.variable = tf.compat.v1.Variable([0.0])

            def compute_gradients(self, *args, **kwargs):
                g = tf.constant([float(hvd.rank() ** 2)])
                if sparse:
                    g = tf.IndexedSlices(g, tf.constant([0]), tf.constant([1]))
                return [(g, self.variable)]

            def _resource_apply_dense(self, grad, var):
                return var.assign_add(grad)

        opt = hvd.DistributedOptimizer(AddGradient(), backward_passes_per_step=steps,
                                       average_aggregated_gradients=average,
                                       process_set=process_set, sparse_as_dense=sparse)
        global_step = tf.compat.v1.Variable(0, dtype=tf.int64, trainable=False)
        update = opt.apply_gradients(opt.compute_gradients(), global_step=global_step)
        with tf.compat.v1.Session() as session:
            session.run([tf.compat.v1.global_variables_initializer(),
                         tf.compat.v1.local_variables_initializer()])
            for _ in range(6):
                session.run(update)
                values.append(float(session.run(opt._optimizer.variable)[0]))
                global_steps.append(int(session.run(global_step)))
    return values, global_steps


def _sec_optimizers(hvd, tf, even):
    import keras

    import hora.keras
    out = {"bpps3_avg": _v1_optimizer_job(hvd, tf, 3, True, hvd.global_process_set),
           "bpps2_sum_sparse": _v1_optimizer_job(hvd, tf, 2, False, hvd.global_process_set,
                                                 sparse=True),
           "even_set": _v1_optimizer_job(hvd, tf, 1, True, even),
           "eager_bpps": _caught(lambda: hvd.DistributedOptimizer(
               tf.compat.v1.train.GradientDescentOptimizer(0.1), backward_passes_per_step=2))}
    wrapped = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    out["keras"] = isinstance(wrapped, hora.keras.DistributedOptimizer)
    out["util"] = (hvd._executing_eagerly(), hvd.util._executing_eagerly())
    return out


def _worker():
    import tensorflow as tf

    import hora.tensorflow as hvd
    from tests.helpers import run_sections
    even, odd = hvd.add_process_set(EVEN), hvd.add_process_set(ODD)
    out = run_sections({
        "dtypes": lambda: _sec_dtypes(hvd, tf),
        "graph_errors": lambda: _sec_graph_errors(hvd, tf),
        "process_sets": lambda: _sec_process_sets(hvd, tf, even, odd),
        # after process_sets, which built different numbers of graphs on different ranks: a
        # collective in a tf.cond branch of a tf.compat.v1 graph (the aggregation's) was
        # named after the branch's graph, whose name counts them, and the ranks hung
        "optimizers": lambda: _sec_optimizers(hvd, tf, even),
    })
    hvd.barrier()
    return out


_QUIET = without(TF_EXTRAS, {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "0"})
job = job_fixture(lambda n: _worker(), env_for=lambda n: _QUIET, timeout_s=120)
pytestmark = pytest.mark.timeout(150)


# -- the tests -------------------------------------------------------------------------------
def test_uint16_through_every_collective(job):
    xs = [_values(("x", r), "uint16", (N, 2)) for r in range(N)]
    total = sum(x.astype(np.int64) for x in xs).astype(np.uint16)
    for r, res in enumerate(section(job(N), "dtypes")):
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


def test_graph_errors_are_tensorflows_types_with_horas_message(job):
    for r, res in enumerate(section(job(N), "graph_errors")):
        for case, name in (("shape", "sh"), ("dtype", "dt"), ("root", "rt"),
                           ("session", "v1")):
            assert res[case] is not None, f"{case}: nothing raised on rank {r}"
            mro, message = res[case]
            assert "FailedPreconditionError" in mro and "CollectiveMismatchError" in mro, \
                (case, mro)
            assert repr(name) in message, (case, message)
        assert "shape" in res["shape"][1] and "rank" in res["shape"][1], res["shape"]
        assert res["after"] == N


def test_process_set_ops_and_membership_errors(job):
    for r, res in enumerate(section(job(N), "process_sets")):
        member = r in EVEN
        assert res["topology"] == [2, int(member), EVEN.index(r) if member else -4, -3, N]
        assert res["eager_included"] == int(r in ODD)
        for what in ("foreign_eager", "unknown"):
            mro, message = res[what]
            assert "InvalidArgumentError" in mro and "ValueError" in mro, (what, mro)
        assert "not a member" in res["foreign_eager"][1], res["foreign_eager"]
        concrete, ran = res["foreign_graph"]
        assert concrete is None, f"tracing on a non-member raised: {concrete}"
        assert "InvalidArgumentError" in ran[0] and "not a member" in ran[1], ran


def test_reducescatter_gradient_on_a_process_set_in_float16(job):
    results = section(job(N), "process_sets")
    for members in (EVEN, ODD):
        for op in ("Sum", "Average"):
            dys = [_values(("dy", op, r), "float32", (4, 2)) for r in members]
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


def test_v1_optimizer_aggregates_backward_passes_and_reduces_on_a_set(job):
    squares = [r ** 2 for r in range(N)]
    mean = sum(squares) / N
    for r, res in enumerate(section(job(N), "optimizers")):
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
