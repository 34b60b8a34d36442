"""Many independent collectives in one ``tf.compat.v1`` ``Session.run``, as Horovod's own
"fused" tests build them: each is a node that holds one of TensorFlow's inter-op threads
while it waits, and every rank's executor starts them in its own order.  With TensorFlow's
default pool (one thread per CPU) two ranks each held two collectives the other had not
reached, and the job stopped for good (hora.tensorflow.threads).  Results are checked
against NumPy on the inputs, which every rank builds from its rank.
"""
import importlib.util

import numpy as np
import pytest

from tests.helpers import TF_EXTRAS, run_ranks, without

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("TensorFlow is not installed (pip install 'hora[tensorflow]')",
                allow_module_level=True)

DTYPES = ["uint8", "int8", "int32", "int64", "float16", "float32", "float64"]
KINDS = ["allreduce", "reducescatter", "allgather"]
REPEATS = 3


def _cases():
    """(kind, dtype, rank of the tensor): Horovod's fused tests' mix, 21 collectives."""
    return [(KINDS[i % 3], dt, 1 + i % 3) for i, dt in enumerate(DTYPES * 3)]


def _input(i, dtype, dims, rank, size):
    rows = 4 * size
    x = (np.arange(rows * 3 ** (dims - 1)) % 7 + i + rank).astype(dtype)
    return x.reshape((rows,) + (3,) * (dims - 1))


def _expected(kind, i, dtype, dims, rank, size):
    xs = [_input(i, dtype, dims, r, size) for r in range(size)]
    if kind == "allgather":
        return np.concatenate(xs)
    total = np.sum(xs, axis=0, dtype=dtype)
    return total if kind == "allreduce" else total[rank * 4:(rank + 1) * 4]


def _fused_session():
    import os

    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    import hora.tensorflow as hvd
    rank, size = hvd.rank(), hvd.size()
    with tf.compat.v1.Session() as sess:
        outs = []
        for i, (kind, dtype, dims) in enumerate(_cases()):
            t = tf.constant(_input(i, dtype, dims, rank, size))
            if kind == "allgather":
                outs.append(hvd.allgather(t))
            else:
                outs.append(getattr(hvd, kind)(t, op=hvd.Sum))
        runs = [sess.run(outs) for _ in range(REPEATS)]
    return os.environ.get("TF_NUM_INTEROP_THREADS"), runs


def test_independent_collectives_in_one_session_run_all_complete():
    np_ = 2
    # (before: at N = 2 on 2 CPUs, both ranks waited for good, each on two of them)
    results = run_ranks(_fused_session, np_, timeout_s=60, env=without(TF_EXTRAS))
    for rank, (threads, runs) in enumerate(results):
        assert threads == "64"
        for run in runs:
            for i, ((kind, dtype, dims), got) in enumerate(zip(_cases(), run)):
                want = _expected(kind, i, dtype, dims, rank, np_)
                assert got.dtype == want.dtype and got.shape == want.shape, (kind, dtype)
                np.testing.assert_array_equal(got, want, err_msg=f"{kind} {dtype} rank {rank}")


def _too_many():
    import warnings

    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    import hora.tensorflow as hvd
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        outs = [hvd.allreduce(tf.constant([float(i)]), op=hvd.Sum) for i in range(5)]
        more = hvd.allreduce(tf.constant([5.0]), op=hvd.Sum)
    with tf.compat.v1.Session() as sess:
        values = sess.run(outs + [more])
    return [str(w.message) for w in seen if w.category is RuntimeWarning], values


def test_a_graph_with_more_collectives_than_threads_warns_once_and_user_setting_kept():
    (said, values), = run_ranks(_too_many, 1, timeout_s=60,
                                env=without(TF_EXTRAS, {"TF_NUM_INTEROP_THREADS": "4"}))
    assert len(said) == 1, said
    assert "holds 5 hora collectives, more than TensorFlow's 4 inter-op threads" in said[0]
    assert "TF_NUM_INTEROP_THREADS" in said[0] and "grouped_allreduce" in said[0]
    assert [v.tolist() for v in values] == [[float(i)] for i in range(6)]
