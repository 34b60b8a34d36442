"""hora.tensorflow's training half on real ranks: DistributedGradientTape, broadcast_variables
and the tf.compat.v1 DistributedOptimizer; variables that ranks hold apart: the in-place
``broadcast_`` (eagerly and inside ``tf.function``, on a process set, Keras variables),
``PartialDistributedGradientTape`` (the local layers' gradients stay on their rank), and the
graph names of unnamed collectives on a process set; and many collectives in one
``tf.compat.v1`` ``Session.run`` against TensorFlow's inter-op threads.

The training oracle is one process training on the whole batch: every rank rebuilds the
global batch from a fixed seed, trains a reference copy of the variables on it locally, and
reports how far its distributed copy (trained on its shard) is from the reference.  The
variables' values come from (VAR_SEED, key, rank), so this process rebuilds them and
computes the expected values with NumPy: the broadcast's are the root's inputs, the partial
tape's are a two-layer linear model's gradients worked out by hand.

TensorFlow takes seconds to import in every process, so one 2-rank job runs every section
and returns plain numbers; a 1-rank job runs the variables' sections again, on the one-rank
paths (every call settled alone, and the partial tape's process set of one), with the
inter-op threads a user set (the warning of a graph with more collectives than those).  The
training sections need an even split of the batch and more than one rank, so they run at
N = 2 only.
"""

import importlib.util
import zlib

import numpy as np
import pytest

# TensorFlow is found, not imported: the ranks import it, this process needs none of it
if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("TensorFlow is not installed (pip install 'hora[tensorflow]')",
                allow_module_level=True)

from tests.helpers import TF_EXTRAS, job_fixture, run_sections, section, without  # noqa: E402
from tests.multiproc import tf_ops_job  # noqa: E402

SEED = 1234
STEPS = 3
BATCH = 8                    # the global batch, split evenly among the ranks
LR = 0.1

# name: (DistributedGradientTape kwargs, options, tolerance)
CONFIGS = {
    "average": ({}, {}, 1e-6),
    "sum_lr_over_size": ({"op": "Sum"}, {"lr_over_size": True}, 1e-6),
    "predivide": ({"gradient_predivide_factor": 2.0}, {}, 1e-6),
    "groups_int": ({"groups": 2}, {}, 1e-6),
    "groups_list": ({"groups": "w1"}, {}, 1e-6),
    "fp16": ({"compression": "fp16"}, {}, 2e-3),
    "sparse": ({}, {"sparse": True}, 1e-6),
    "sparse_as_dense": ({"sparse_as_dense": True}, {"sparse": True}, 1e-6),
}


# -- everything below runs in the workers --------------------------------------------------
def _variables(tf, sparse):
    rng = np.random.default_rng(SEED)
    shapes = {"w1": (4, 6), "b1": (6,), "w2": (6, 3), "b2": (3,)}
    if sparse:
        shapes["emb"] = (10, 4)
    return {k: tf.Variable(rng.standard_normal(s).astype(np.float32) * 0.5, name=k)
            for k, s in shapes.items()}


def _batch(step):
    rng = np.random.default_rng(SEED + 1 + step)
    return (rng.standard_normal((BATCH, 4)).astype(np.float32),
            rng.standard_normal((BATCH, 3)).astype(np.float32),
            rng.integers(0, 10, (BATCH, 2)))


def _loss(tf, v, x, y, ids):
    if "emb" in v:
        x = x + tf.reduce_sum(tf.gather(v["emb"], ids), axis=1)
    h = tf.tanh(tf.matmul(x, v["w1"]) + v["b1"])
    return tf.reduce_mean(tf.square(tf.matmul(h, v["w2"]) + v["b2"] - y))


def _sgd(tf, variables, grads, lr):
    for var, g in zip(variables, grads):
        var.assign_sub(lr * tf.convert_to_tensor(g))     # IndexedSlices: duplicates summed


def _train_pair(name, graph):
    import tensorflow as tf

    import hora
    import hora.tensorflow as hvd
    from hora.tensorflow.compression import Compression
    kwargs, opts, tol = CONFIGS[name]
    kwargs = dict(kwargs)
    if "op" in kwargs:
        kwargs["op"] = getattr(hora.core, kwargs["op"])
    if "compression" in kwargs:
        kwargs["compression"] = getattr(Compression, kwargs["compression"])
    ref, dist = _variables(tf, opts.get("sparse")), _variables(tf, opts.get("sparse"))
    if kwargs.get("groups") == "w1":
        kwargs["groups"] = [[dist["w1"], dist["b2"]]]
    lr = LR / hora.size() if opts.get("lr_over_size") else LR
    r, n = hora.rank(), hora.size()
    kinds = set()

    def dist_step(x, y, ids):
        with tf.GradientTape() as tape:
            loss = _loss(tf, dist, x, y, ids)
        tape = hvd.DistributedGradientTape(tape, **kwargs)
        grads = tape.gradient(loss, list(dist.values()))
        kinds.update(type(g).__name__ for g in grads)
        _sgd(tf, dist.values(), grads, lr)

    step = tf.function(dist_step) if graph else dist_step
    for s in range(STEPS):
        x, y, ids = _batch(s)
        with tf.GradientTape() as tape:
            loss = _loss(tf, ref, x, y, ids)
        _sgd(tf, ref.values(), tape.gradient(loss, list(ref.values())), LR)
        shard = slice(r * BATCH // n, (r + 1) * BATCH // n)
        step(x[shard], y[shard], ids[shard])
    diff = max(float(np.abs(a.numpy() - b.numpy()).max()) for a, b in
               zip(ref.values(), dist.values()))
    return diff, tol, sorted(kinds)


def _sec_equivalence(graph):
    return {name: _train_pair(name, graph) for name in CONFIGS}


def _sec_broadcast():
    import tensorflow as tf

    import hora
    import hora.tensorflow as hvd
    r = hora.rank()
    v = [tf.Variable(np.full((2, 3), r, np.float32)), tf.Variable(np.int64(10 + r)),
         tf.Variable([r == 0, r == 1])]
    hvd.broadcast_variables(v, root_rank=0)
    eager = [x.numpy().tolist() for x in v]
    for x, init in zip(v, [np.full((2, 3), r, np.float32), np.int64(10 + r), [r == 0, r == 1]]):
        x.assign(init)

    @tf.function
    def from_last():
        hvd.broadcast_variables(v, root_rank=hora.size() - 1)
    from_last()
    return eager, [x.numpy().tolist() for x in v]


def _sec_tape_forms():
    """A None gradient, a local source, and the tape wrapped before recording."""
    import tensorflow as tf

    import hora
    import hora.tensorflow as hvd
    used, unused, local = tf.Variable([1.0, 2.0]), tf.Variable(3.0), tf.Variable(1.0)

    def loss_fn():
        return (tf.reduce_sum(used * used) + local) * float(hora.rank() + 1)

    def wrapped_after():
        with tf.GradientTape() as tape:
            loss = loss_fn()
        tape = hvd.DistributedGradientTape(tape)
        tape.register_local_source(local)
        return tape.gradient(loss, [used, unused, local])

    def wrapped_before():
        with hvd.DistributedGradientTape(tf.GradientTape()) as tape:
            loss = loss_fn()
        return tape.gradient(loss, [used, unused, local])
    out = {}
    for name, fn in (("after", wrapped_after), ("before", wrapped_before)):
        for mode, run in (("eager", fn), ("graph", tf.function(fn))):
            g_used, g_unused, g_local = run()
            out[name, mode] = (g_used.numpy().tolist(), g_unused, float(g_local))
    return out


def _sec_v1_optimizer():
    """tf.compat.v1: minimize() with DistributedOptimizer in a session whose hook broadcasts
    rank 0's initial variables; without groups, and with two groups chained in the graph."""
    import tensorflow as tf

    import hora
    import hora.tensorflow as hvd
    r, n = hora.rank(), hora.size()
    x_all, y_all, _ = _batch(0)
    shard = slice(r * BATCH // n, (r + 1) * BATCH // n)
    w_ref, b_ref = np.zeros((4, 3), np.float32), np.zeros(3, np.float32)  # rank 0's start
    for _ in range(STEPS):                                   # on the whole batch
        err = 2 * (x_all @ w_ref + b_ref - y_all) / y_all.size
        w_ref, b_ref = w_ref - LR * x_all.T @ err, b_ref - LR * err.sum(0)
    out = {}
    for grouped in (False, True):
        with tf.Graph().as_default():
            w = tf.compat.v1.get_variable("w", initializer=np.full((4, 3), r, np.float32))
            b = tf.compat.v1.get_variable("b", initializer=np.full(3, r, np.float32))
            loss = tf.reduce_mean(tf.square(tf.matmul(x_all[shard], w) + b - y_all[shard]))
            opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR),
                                           groups=[[b]] if grouped else None)
            train = opt.minimize(loss)
            hooks = [hvd.BroadcastGlobalVariablesHook(0)]
            with tf.compat.v1.train.MonitoredSession(hooks=hooks) as sess:
                for _ in range(STEPS):
                    sess.run(train)
                got_w, got_b = sess.run([w, b])
        out[grouped] = max(float(np.abs(got_w - w_ref).max()),
                           float(np.abs(got_b - b_ref).max()))
    return out


# -- many collectives in one tf.compat.v1 Session.run, and TensorFlow's inter-op threads ---
# As Horovod's own "fused" tests build them: each is a node that holds one of TensorFlow's
# inter-op threads while it waits, and every rank's executor starts them in its own order.
# With TensorFlow's default pool (one thread per CPU) two ranks each held two collectives the
# other had not reached, and the job stopped for good (hora.tensorflow.threads).  Results are
# checked against NumPy on the inputs, which every rank builds from its rank.
FUSED_DTYPES = ["uint8", "int8", "int32", "int64", "float16", "float32", "float64"]
FUSED_KINDS = ["allreduce", "reducescatter", "allgather"]
REPEATS = 3
USER_THREADS = "4"          # the 1-rank job's TF_NUM_INTEROP_THREADS, a user's setting


def _fused_cases():
    """(kind, dtype, rank of the tensor): Horovod's fused tests' mix, 21 collectives."""
    return [(FUSED_KINDS[i % 3], dt, 1 + i % 3) for i, dt in enumerate(FUSED_DTYPES * 3)]


def _fused_input(i, dtype, dims, rank, size):
    rows = 4 * size
    x = (np.arange(rows * 3 ** (dims - 1)) % 7 + i + rank).astype(dtype)
    return x.reshape((rows,) + (3,) * (dims - 1))


def _fused_expected(kind, i, dtype, dims, rank, size):
    xs = [_fused_input(i, dtype, dims, r, size) for r in range(size)]
    if kind == "allgather":
        return np.concatenate(xs)
    total = np.sum(xs, axis=0, dtype=dtype)
    return total if kind == "allreduce" else total[rank * 4:(rank + 1) * 4]


def _sec_fused_session(hvd, tf):
    import os
    rank, size = hvd.rank(), hvd.size()
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        outs = []
        for i, (kind, dtype, dims) in enumerate(_fused_cases()):
            t = tf.constant(_fused_input(i, dtype, dims, rank, size))
            if kind == "allgather":
                outs.append(hvd.allgather(t))
            else:
                outs.append(getattr(hvd, kind)(t, op=hvd.Sum))
        runs = [sess.run(outs) for _ in range(REPEATS)]
    return os.environ.get("TF_NUM_INTEROP_THREADS"), runs


def _sec_too_many(hvd, tf):
    """A v1 graph of 6 collectives with the user's 4 inter-op threads."""
    import warnings
    with tf.Graph().as_default():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            outs = [hvd.allreduce(tf.constant([float(i)]), op=hvd.Sum) for i in range(5)]
            more = hvd.allreduce(tf.constant([5.0]), op=hvd.Sum)
        with tf.compat.v1.Session() as sess:
            values = sess.run(outs + [more])
    return [str(w.message) for w in seen if w.category is RuntimeWarning], values


_SECTIONS = {"eager": lambda: _sec_equivalence(False), "graph": lambda: _sec_equivalence(True),
             "broadcast": _sec_broadcast, "tape_forms": _sec_tape_forms,
             "v1_optimizer": _sec_v1_optimizer}


def _worker(n):
    import tensorflow as tf

    import hora.tensorflow as hvd
    sections = dict(_SECTIONS) if n == 2 else {}
    sections.update({"fused_session": lambda: _sec_fused_session(hvd, tf)} if n == 2 else
                    {"too_many": lambda: _sec_too_many(hvd, tf)})
    # after the training sections: these add and remove process sets
    sections.update({"broadcast_inplace": lambda: _sec_broadcast_inplace(hvd, tf, n),
                     "broadcast_set_keras": lambda: _sec_broadcast_set_and_keras(hvd, tf, n),
                     "partial_tape": lambda: _sec_partial_tape(hvd, tf, n),
                     "set_names": lambda: _sec_set_names(hvd, tf, n)})
    return run_sections(sections)


def _env(n):
    """The 2-rank job leaves TF_NUM_INTEROP_THREADS to hora (the fused session checks the
    pool hora asks for); the 1-rank job sets it, as a user may (hora keeps it, and warns of
    a graph with more collectives than that)."""
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0"}
    if n == 1:
        env["TF_NUM_INTEROP_THREADS"] = USER_THREADS
    return without(TF_EXTRAS, env)


# the 2-rank job does the work of a training job, a variables job and a fused session: its
# bound is the sum of theirs (100 s, 120 s and 60 s)
job = job_fixture(_worker, env_for=_env, timeout_s=280, sizes={1, 2})
pytestmark = pytest.mark.timeout(310)


# -- the tests -----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_tape_on_shards_equals_one_process_on_the_whole_batch(job, mode):
    for rank, res in enumerate(section(job(2), mode)):
        for name, (diff, tol, kinds) in res.items():
            assert diff <= tol, f"{mode} {name}: rank {rank} is {diff:g} from the reference"
            if name == "sparse":
                assert "IndexedSlices" in kinds, (name, kinds)
            if name == "sparse_as_dense":
                assert "IndexedSlices" not in kinds, (name, kinds)


def test_broadcast_variables_gives_every_rank_the_roots_values(job):
    for eager, graph in section(job(2), "broadcast"):
        assert eager == [[[0.0] * 3] * 2, 10, [True, False]]
        assert graph == [[[1.0] * 3] * 2, 11, [False, True]]


def test_none_gradients_local_sources_and_a_tape_wrapped_before_recording(job):
    for rank, forms in enumerate(section(job(2), "tape_forms")):
        for (wrapped, mode), (used, unused, local) in forms.items():
            assert used == [3.0, 6.0], (wrapped, mode)        # 2 * w * mean(1, 2)
            assert unused is None, (wrapped, mode)
            # registered (after): this rank's own gradient / size; else the average
            assert local == ((rank + 1) / 2 if wrapped == "after" else 1.5), (wrapped, mode)


def test_v1_distributed_optimizer_and_broadcast_hook(job):
    for rank, diffs in enumerate(section(job(2), "v1_optimizer")):
        for grouped, diff in diffs.items():
            assert diff < 1e-5, f"groups={grouped}: rank {rank} is {diff:g} from the reference"


VAR_SEED = 20261125
SIZES = [1, 2]
DTYPES = ["float32", "float64", "int32", "int64", "bfloat16", "bool"]
SHAPES = [(3, 4), (), (5,)]
LAYER_BATCH, IN, HIDDEN, OUT = 4, 3, 5, 2


def _values(key, dtype, shape):
    """Small integers (exact in every dtype); bool for bool; bfloat16 as float64."""
    rng = np.random.default_rng([VAR_SEED, zlib.crc32(repr(key).encode())])
    if dtype == "bool":
        return rng.random(shape) < 0.5
    return rng.integers(-8, 9, size=shape).astype("float64" if dtype == "bfloat16" else dtype)


def _model_inputs(rank):
    """The shared layer's weights (the same on every rank), this rank's local layer and
    batch."""
    def f(key, shape):
        rng = np.random.default_rng([VAR_SEED, zlib.crc32(repr(key).encode())])
        return (rng.standard_normal(shape) * 0.5).astype(np.float32)
    return {"w1": f("w1", (IN, HIDDEN)), "b1": f("b1", (HIDDEN,)),
            "w2": f(("w2", rank), (HIDDEN, OUT)), "b2": f(("b2", rank), (OUT,)),
            "x": f(("x", rank), (LAYER_BATCH, IN)), "y": f(("y", rank), (LAYER_BATCH, OUT))}


# -- the variables' sections (run in the workers) -----------------------------------------
def _numpy(t):
    t = t.numpy() if hasattr(t, "numpy") else np.asarray(t)
    return t.astype(np.float64) if t.dtype.name == "bfloat16" else t


def _shape(i):
    return SHAPES[i % len(SHAPES)]


def _dtype_variables(tf):
    return [tf.Variable(tf.zeros(_shape(i), dt)) for i, dt in enumerate(DTYPES)]


def _reset(tf, variables, tag, rank):
    for i, (v, dt) in enumerate(zip(variables, DTYPES)):
        v.assign(tf.cast(_values((tag, i, rank), dt, _shape(i)), v.dtype))


def _sec_broadcast_inplace(hvd, tf, n):
    r, root = hvd.rank(), n - 1
    v = _dtype_variables(tf)
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


# -- the variables' oracle ---------------------------------------------------------------------
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


# -- the variables' tests ----------------------------------------------------------------------
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
        tf_ops_job.assert_refused_on_rank0(res["bad"], r, "complex")
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


# -- the inter-op threads' tests ---------------------------------------------------------------
def test_independent_collectives_in_one_session_run_all_complete(job):
    # (before: at N = 2 on 2 CPUs, both ranks waited for good, each on two of them)
    for rank, (threads, runs) in enumerate(section(job(2), "fused_session")):
        assert threads == "64"
        for run in runs:
            for i, ((kind, dtype, dims), got) in enumerate(zip(_fused_cases(), run)):
                want = _fused_expected(kind, i, dtype, dims, rank, 2)
                assert got.dtype == want.dtype and got.shape == want.shape, (kind, dtype)
                np.testing.assert_array_equal(got, want, err_msg=f"{kind} {dtype} rank {rank}")


def test_a_graph_with_more_collectives_than_threads_warns_once_and_user_setting_kept(job):
    (said, values), = section(job(1), "too_many")
    assert len(said) == 1, said
    assert "holds 5 hora collectives, more than TensorFlow's 4 inter-op threads" in said[0]
    assert "TF_NUM_INTEROP_THREADS" in said[0] and "grouped_allreduce" in said[0]
    assert [v.tolist() for v in values] == [[float(i)] for i in range(6)]
