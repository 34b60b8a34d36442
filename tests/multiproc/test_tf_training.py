"""hora.tensorflow's training half on real ranks: DistributedGradientTape, broadcast_variables
and the tf.compat.v1 DistributedOptimizer.

The oracle is one process training on the whole batch: every rank rebuilds the global batch
from a fixed seed, trains a reference copy of the variables on it locally, and reports how
far its distributed copy (trained on its shard) is from the reference.  TensorFlow takes
seconds to import, so one 2-rank job runs every section and returns plain numbers.
"""

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from tests.helpers import TF_EXTRAS, job_fixture, run_sections, section, without  # noqa: E402

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


_SECTIONS = {"eager": lambda: _sec_equivalence(False), "graph": lambda: _sec_equivalence(True),
             "broadcast": _sec_broadcast, "tape_forms": _sec_tape_forms,
             "v1_optimizer": _sec_v1_optimizer}


def _worker(n):
    return run_sections(_SECTIONS)


job = job_fixture(_worker, env_for=lambda n: without(TF_EXTRAS, {"TF_CPP_MIN_LOG_LEVEL": "2"}),
                  timeout_s=100, sizes={2})


# -- the tests -----------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_tape_on_shards_equals_one_process_on_the_whole_batch(job, mode):
    for rank, res in enumerate(section(job(2), mode)):
        for name, (diff, tol, kinds) in res.items():
            assert diff <= tol, f"{mode} {name}: rank {rank} is {diff:g} from the reference"
            if name == "sparse":
                assert "IndexedSlices" in kinds, (name, kinds)
            if name == "sparse_as_dense":
                assert "IndexedSlices" not in kinds, (name, kinds)


@pytest.mark.timeout(120)
def test_broadcast_variables_gives_every_rank_the_roots_values(job):
    for eager, graph in section(job(2), "broadcast"):
        assert eager == [[[0.0] * 3] * 2, 10, [True, False]]
        assert graph == [[[1.0] * 3] * 2, 11, [False, True]]


@pytest.mark.timeout(120)
def test_none_gradients_local_sources_and_a_tape_wrapped_before_recording(job):
    for rank, forms in enumerate(section(job(2), "tape_forms")):
        for (wrapped, mode), (used, unused, local) in forms.items():
            assert used == [3.0, 6.0], (wrapped, mode)        # 2 * w * mean(1, 2)
            assert unused is None, (wrapped, mode)
            # registered (after): this rank's own gradient / size; else the average
            assert local == ((rank + 1) / 2 if wrapped == "after" else 1.5), (wrapped, mode)


@pytest.mark.timeout(120)
def test_v1_distributed_optimizer_and_broadcast_hook(job):
    for rank, diffs in enumerate(section(job(2), "v1_optimizer")):
        for grouped, diff in diffs.items():
            assert diff < 1e-5, f"groups={grouped}: rank {rank} is {diff:g} from the reference"
