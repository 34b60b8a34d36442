"""hora.tensorflow on variables that ranks hold apart, on real ranks: the in-place
``broadcast_`` (eagerly and inside ``tf.function``, on a process set, Keras variables) and
``PartialDistributedGradientTape`` (the local layers' gradients stay on their rank), plus
the graph names of unnamed collectives on a process set.

Every rank's values come from (SEED, key, rank), so this process rebuilds them and computes
the expected values with NumPy: the broadcast's are the root's inputs, the tape's are a
two-layer linear model's gradients worked out by hand.  One job per N runs every section
and returns plain NumPy values (TensorFlow takes seconds to import).
"""
import importlib.util
import zlib

import numpy as np
import pytest

from tests.helpers import TF_EXTRAS, job_fixture, run_sections, section, without

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("TensorFlow is not installed (pip install 'hora[tensorflow]')",
                allow_module_level=True)

SEED = 20261125
SIZES = [1, 2]
DTYPES = ["float32", "float64", "int32", "int64", "bfloat16", "bool"]
SHAPES = [(3, 4), (), (5,)]
BATCH, IN, HIDDEN, OUT = 4, 3, 5, 2


def _values(key, dtype, shape):
    """Small integers (exact in every dtype); bool for bool; bfloat16 as float64."""
    rng = np.random.default_rng([SEED, zlib.crc32(repr(key).encode())])
    if dtype == "bool":
        return rng.random(shape) < 0.5
    return rng.integers(-8, 9, size=shape).astype("float64" if dtype == "bfloat16" else dtype)


def _model_inputs(rank):
    """The shared layer's weights (the same on every rank), this rank's local layer and
    batch."""
    def f(key, shape):
        rng = np.random.default_rng([SEED, zlib.crc32(repr(key).encode())])
        return (rng.standard_normal(shape) * 0.5).astype(np.float32)
    return {"w1": f("w1", (IN, HIDDEN)), "b1": f("b1", (HIDDEN,)),
            "w2": f(("w2", rank), (HIDDEN, OUT)), "b2": f(("b2", rank), (OUT,)),
            "x": f(("x", rank), (BATCH, IN)), "y": f(("y", rank), (BATCH, OUT))}


# -- everything below runs in the workers --------------------------------------------------
def _numpy(t):
    t = t.numpy() if hasattr(t, "numpy") else np.asarray(t)
    return t.astype(np.float64) if t.dtype.name == "bfloat16" else t


def _shape(i):
    return SHAPES[i % len(SHAPES)]


def _variables(tf):
    return [tf.Variable(tf.zeros(_shape(i), dt)) for i, dt in enumerate(DTYPES)]


def _reset(tf, variables, tag, rank):
    for i, (v, dt) in enumerate(zip(variables, DTYPES)):
        v.assign(tf.cast(_values((tag, i, rank), dt, _shape(i)), v.dtype))


def _sec_broadcast_inplace(hvd, tf, n):
    r, root = hvd.rank(), n - 1
    v = _variables(tf)
    _reset(tf, v, "eager", r)
    out = {}
    returned = hvd.broadcast_(v, root_rank=root)
    out["eager"] = ([_numpy(x) for x in v], [_numpy(x) for x in returned],
                    type(returned).__name__)
    fn = tf.function(lambda: hvd.broadcast_(v, root_rank=root, name="inplace"))
    for call in ("graph1", "graph2"):            # the second call broadcasts again
        _reset(tf, v, call, r)
        returned = fn()
        out[call] = ([_numpy(x) for x in v], [_numpy(x) for x in returned])
    out["empty"] = hvd.broadcast_([], root_rank=0)
    try:
        hvd.broadcast_([tf.constant(1.0)], root_rank=0)
    except TypeError as e:
        out["tensor"] = str(e)
    # a bad variable on rank 0 only: it raises TypeError, the others are told
    bad = [tf.Variable([1.0]), tf.Variable([1j] if r == 0 else [1.0])]
    try:
        hvd.broadcast_(bad, root_rank=root)
    except Exception as e:  # noqa: BLE001 - the test checks the type
        out["bad"] = ([c.__name__ for c in type(e).__mro__], str(e))
    # the automatic names are still in step
    after = [tf.Variable([float(r)])]
    out["after"] = _numpy(hvd.broadcast_(after, root_rank=root)[0])
    return out


def _sec_broadcast_set_and_keras(hvd, tf, n):
    import keras
    r = hvd.rank()
    ps = hvd.add_process_set([0])               # N = 2: rank 1 stays out
    v = [tf.Variable(np.full((2, 2), float(r + 1), np.float32))]
    if ps.included():
        hvd.broadcast_(v, root_rank=0, process_set=ps)
        tf.function(lambda: hvd.broadcast_(v, root_rank=0, process_set=ps))()
    kv = [keras.Variable(np.full((3,), float(10 * r), np.float32)),
          keras.Variable(np.full((2, 1), float(r), np.float64))]
    hvd.broadcast_(kv, root_rank=n - 1)
    hvd.remove_process_set(ps)
    return {"set": _numpy(v[0]), "keras": [_numpy(tf.convert_to_tensor(x)) for x in kv]}


def _model(tf, rank):
    import keras
    m = _model_inputs(rank)
    shared, local = keras.layers.Dense(HIDDEN), keras.layers.Dense(OUT)
    shared.build((None, IN))
    local.build((None, HIDDEN))
    shared.set_weights([m["w1"], m["b1"]])
    local.set_weights([m["w2"], m["b2"]])
    return shared, local, m


def _sec_partial_tape(hvd, tf, n):
    r = hvd.rank()
    shared, local, m = _model(tf, r)
    weights = shared.trainable_weights + local.trainable_weights
    x, y = tf.constant(m["x"]), tf.constant(m["y"])

    def grads(**kwargs):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(local(shared(x)) - y))
        tape = hvd.PartialDistributedGradientTape(tape, **kwargs)
        return tape.gradient(loss, weights)

    def split(**kwargs):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(local(shared(x)) - y))
        tape = hvd.PartialDistributedGradientTape(tape, **kwargs)
        loc, glob = tape.get_local_and_global_gradients(loss, weights)
        return [g for _, g in loc], [g for _, g in glob]

    configs = {"list": {"local_layers": [local]}, "one": {"local_layers": local},
               "unscaled": {"local_layers": [local], "scale_local_gradients": False},
               "none": {}}
    out = {}
    for name, kwargs in configs.items():
        out[name, "eager"] = [_numpy(g) for g in grads(**kwargs)]
        out[name, "graph"] = [_numpy(g) for g in tf.function(lambda: grads(**kwargs))()]
    loc, glob = split(local_layers=[local])
    out["split"] = ([_numpy(g) for g in loc], [_numpy(g) for g in glob])
    try:
        hvd.PartialDistributedGradientTape(tf.GradientTape(), local_layers=[local, "x"])
    except ValueError as e:
        out["bad_layer"] = str(e)
    return out


def _sec_set_names(hvd, tf, n):
    """Unnamed collectives on a set (rank 0 alone) traced on its member only, then unnamed
    global ones in the same function, and eagerly: the global ones' names agree."""
    r = hvd.rank()
    ps = hvd.add_process_set([0])
    x = tf.constant(np.arange(3, dtype=np.float32) + r)

    def step():
        out = []
        if ps.included():
            out.append(hvd.allreduce(x, op=hvd.Sum, process_set=ps))
            out.append(hvd.broadcast(x, root_rank=0, process_set=ps))
        out.append(hvd.allreduce(x, op=hvd.Sum))
        out.append(hvd.allgather(x[:1]))
        return out
    graph = [_numpy(t) for t in tf.function(step)()]
    eager = [_numpy(t) for t in step()]
    hvd.remove_process_set(ps)
    return {"graph": graph[-2:], "eager": eager[-2:]}


def _worker(n):
    import tensorflow as tf

    import hora.tensorflow as hvd
    sections = {"broadcast_inplace": lambda: _sec_broadcast_inplace(hvd, tf, n),
                "broadcast_set_keras": lambda: _sec_broadcast_set_and_keras(hvd, tf, n),
                "partial_tape": lambda: _sec_partial_tape(hvd, tf, n),
                "set_names": lambda: _sec_set_names(hvd, tf, n)}
    return run_sections(sections)


job = job_fixture(_worker, env_for=lambda n: without(TF_EXTRAS, {"TF_CPP_MIN_LOG_LEVEL": "2",
                                                                "TF_ENABLE_ONEDNN_OPTS": "0"}),
                  timeout_s=120)
pytestmark = pytest.mark.timeout(150)


# -- the oracle --------------------------------------------------------------------------------
def _expected_variables(tag, root):
    return [_values((tag, i, root), dt, _shape(i)) for i, dt in enumerate(DTYPES)]


def _assert_variables(got, exp, what):
    assert len(got) == len(exp), what
    for i, (g, e) in enumerate(zip(got, exp)):
        assert g.shape == e.shape, f"{what} {DTYPES[i]}: shape {g.shape}, expected {e.shape}"
        np.testing.assert_array_equal(g, e, err_msg=f"{what} {DTYPES[i]}")


def _gradients(rank):
    """d mean((x w1 + b1) w2 + b2 - y)^2 by hand: [w1, b1, w2, b2]."""
    m = {k: v.astype(np.float64) for k, v in _model_inputs(rank).items()}
    h = m["x"] @ m["w1"] + m["b1"]
    dz = 2 * (h @ m["w2"] + m["b2"] - m["y"]) / m["y"].size
    dh = dz @ m["w2"].T
    return [m["x"].T @ dh, dh.sum(0), h.T @ dz, dz.sum(0)]


# -- the tests -------------------------------------------------------------------------------
@pytest.mark.parametrize("n", SIZES)
def test_broadcast_inplace_assigns_the_roots_values(job, n):
    root = n - 1
    for r, res in enumerate(section(job(n), "broadcast_inplace")):
        after, returned, kind = res["eager"]
        assert kind == "list"
        _assert_variables(after, _expected_variables("eager", root), f"rank {r} eager")
        _assert_variables(returned, _expected_variables("eager", root), f"rank {r} returned")
        for call in ("graph1", "graph2"):
            after, returned = res[call]
            _assert_variables(after, _expected_variables(call, root), f"rank {r} {call}")
            _assert_variables(returned, _expected_variables(call, root), f"rank {r} {call}")
        assert res["empty"] == []
        assert "broadcast_" in res["tensor"] and "EagerTensor" in res["tensor"]
        mro, message = res["bad"]
        if r == 0:
            assert mro[0] == "TypeError" and "complex" in message, (mro, message)
        else:
            assert "CollectiveAbortedError" in mro and "FailedPreconditionError" in mro, mro
            assert "rank 0" in message and "complex" in message, message
        assert res["after"].tolist() == [float(root)], "the automatic names fell apart"


@pytest.mark.parametrize("n", SIZES)
def test_broadcast_inplace_on_a_process_set_and_keras_variables(job, n):
    for r, res in enumerate(section(job(n), "broadcast_set_keras")):
        # rank 0 alone in the set: everyone keeps its own value
        np.testing.assert_array_equal(res["set"], np.full((2, 2), float(r + 1), np.float32))
        a, b = res["keras"]
        np.testing.assert_array_equal(a, np.full((3,), 10.0 * (n - 1), np.float32))
        np.testing.assert_array_equal(b, np.full((2, 1), float(n - 1)))
        assert (a.dtype, b.dtype) == (np.float32, np.float64)


@pytest.mark.parametrize("n", SIZES)
def test_partial_tape_keeps_the_local_layers_gradients_local(job, n):
    per_rank = [_gradients(r) for r in range(n)]
    shared_mean = [sum(g[i] for g in per_rank) / n for i in range(4)]
    for r, res in enumerate(section(job(n), "partial_tape")):
        own = per_rank[r]
        expected = {"list": shared_mean[:2] + [g / n for g in own[2:]],
                    "one": shared_mean[:2] + [g / n for g in own[2:]],
                    "unscaled": shared_mean[:2] + own[2:],
                    "none": shared_mean}
        for (name, mode), got in ((k, v) for k, v in res.items() if isinstance(k, tuple)):
            for i, (g, e) in enumerate(zip(got, expected[name])):
                np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6,
                                           err_msg=f"rank {r} {name} {mode} weight {i}")
        local, shared = res["split"]
        for g, e in zip(local + shared, [x / n for x in own[2:]] + shared_mean[:2]):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6, err_msg=f"rank {r} split")
        assert "Keras layers" in res["bad_layer"] and "str" in res["bad_layer"]


@pytest.mark.parametrize("n", SIZES)
def test_unnamed_graph_collectives_on_a_set_leave_the_global_names_alone(job, n):
    xs = [np.arange(3, dtype=np.float32) + r for r in range(n)]
    for r, res in enumerate(section(job(n), "set_names")):
        for mode in ("graph", "eager"):
            total, gathered = res[mode]
            np.testing.assert_array_equal(total, sum(xs), err_msg=f"rank {r} {mode}")
            np.testing.assert_array_equal(gathered, [x[0] for x in xs],
                                          err_msg=f"rank {r} {mode}")
