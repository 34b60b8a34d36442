"""hora.tensorflow.keras on Keras 2 (tf_keras, ``TF_USE_LEGACY_KERAS=1``) on real ranks.

One job of two ranks runs every section (TensorFlow takes seconds to import).  The oracle
for training is one process fitting the whole batch, as in test_keras.py: each rank fits its
share of the reference copies on all the data without hora and its own copy on its shard with
``DistributedOptimizer``, and the test compares every rank's copy with the reference.
Gradient and callback checks compare with what the test computes from every rank's raw
numbers (Horovod's own expectations where it has a test).  The
``tf.compat.v1`` section runs in a graph and session of its own, as Horovod's v1 tests do.
"""
import importlib.util
import os

import numpy as np
import pytest

if importlib.util.find_spec("tf_keras") is None or importlib.util.find_spec("tensorflow") is None:
    pytest.skip("tf_keras (tf-keras) is not installed", allow_module_level=True)

from tests.helpers import (TF_EXTRAS, run_digits_example, run_ranks, run_sections,  # noqa: E402
                           section, without)

pytestmark = pytest.mark.timeout(200)

SEED = 11
BATCH = 8                     # the global batch, split evenly among the ranks
STEPS = 4                     # batches per epoch
FEATURES = 5
TOL = 2e-5
ENV = {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}


# -- everything below runs in the workers --------------------------------------------------
def _data():
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((STEPS * BATCH, FEATURES)).astype(np.float32)
    y = rng.standard_normal((STEPS * BATCH, 2)).astype(np.float32)
    return x, y


def _shard(a, r, n):
    """Rank r's rows of every global batch, in batch order."""
    per = BATCH // n
    return a.reshape(STEPS, BATCH, *a.shape[1:])[:, r * per:(r + 1) * per].reshape(
        -1, *a.shape[1:])


def _model(seed):
    from tensorflow import keras
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.layers.Dense(8, activation="tanh", input_shape=(FEATURES,)),
                             keras.layers.Dense(2)])


def _plain_class():
    """A custom optimizer of the new family: a bare gradient step."""
    from tensorflow import keras

    class Plain(keras.optimizers.Optimizer):
        def __init__(self, learning_rate=0.1, name="Plain", **kwargs):
            super().__init__(name=name, **kwargs)
            self._learning_rate = self._build_learning_rate(learning_rate)

        def update_step(self, gradient, variable):
            variable.assign_sub(tf_cast(self.learning_rate, variable.dtype) * gradient)

        def get_config(self):
            config = super().get_config()
            config["learning_rate"] = self._serialize_hyperparameter(self._learning_rate)
            return config
    return Plain


def tf_cast(x, dtype):
    import tensorflow as tf
    return tf.cast(x, dtype)


OPTIMIZERS = {
    "sgd": lambda k: k.optimizers.SGD(learning_rate=0.1, momentum=0.5),
    "legacy_sgd_lr_decay": lambda k: k.optimizers.legacy.SGD(lr=0.1, momentum=0.5, decay=0.01),
    "adam": lambda k: k.optimizers.Adam(0.01),
    "legacy_adam": lambda k: k.optimizers.legacy.Adam(0.01),
    "custom": lambda k: _plain_class()(0.1),
}


# the distributed fits, as (optimizer, backward passes per step, groups)
CONFIGS = {"sgd": ("sgd", 1, None), "legacy_sgd_lr_decay": ("legacy_sgd_lr_decay", 1, None),
           "adam": ("adam", 1, None), "legacy_adam": ("legacy_adam", 1, None),
           "custom": ("custom", 1, None), "sgd/groups2": ("sgd", 1, 2),
           "sgd/passes2": ("sgd", 2, None)}
# the one-process fits they are compared with: groups change nothing in one process, so
# sgd/groups2 shares sgd's
REFERENCES = sorted({(kind, passes) for kind, passes, _ in CONFIGS.values()})


def _reference(kind, passes):
    """Rank 0's start fitted on the whole batch in this process alone, without hora."""
    from tensorflow import keras
    x, y = _data()
    ref = _model(SEED)
    ref.compile(optimizer=OPTIMIZERS[kind](keras), loss=keras.losses.mean_squared_error)
    ref.fit(x, y, batch_size=BATCH * passes, epochs=2, shuffle=False, verbose=0)
    return ref.get_weights()


def _distributed(kind, passes, groups):
    """Every rank's own start, fitted on its shard with DistributedOptimizer."""
    from tensorflow import keras

    import hora.tensorflow.keras as hvd
    r, n = hvd.rank(), hvd.size()
    x, y = _data()
    dist = _model(SEED + r)
    opt = hvd.DistributedOptimizer(OPTIMIZERS[kind](keras), backward_passes_per_step=passes,
                                   average_aggregated_gradients=passes > 1, groups=groups)
    dist.compile(optimizer=opt, loss=keras.losses.mean_squared_error)
    dist.fit(_shard(x, r, n), _shard(y, r, n), batch_size=BATCH // n, epochs=2, shuffle=False,
             verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    return dist.get_weights(), int(opt.iterations.numpy()), type(opt).__name__


def _sec_equivalence():
    """Rank r fits the references whose index is r modulo the size (each is fitted once, a
    reference being the same computation on every rank), then every config."""
    import hora.tensorflow.keras as hvd
    r, n = hvd.rank(), hvd.size()
    refs = {ref: _reference(*ref) for i, ref in enumerate(REFERENCES) if i % n == r}
    return refs, {name: _distributed(*config) for name, config in CONFIGS.items()}


def _sec_batchnorm():
    """BatchNormalization(fused=...) trains under DistributedOptimizer: the trainable weights
    stay the same on every rank (its moving statistics are each rank's own)."""
    from tensorflow import keras

    import hora.tensorflow.keras as hvd
    r, n = hvd.rank(), hvd.size()
    x, y = _data()
    keras.utils.set_random_seed(SEED + r)
    model = keras.Sequential([keras.layers.Dense(4, input_shape=(FEATURES,)),
                              keras.layers.BatchNormalization(fused=False),
                              keras.layers.Dense(2)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(lr=0.05)),
                  loss=keras.losses.mean_squared_error)
    model.fit(_shard(x, r, n), _shard(y, r, n), batch_size=BATCH // n, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    return [w.numpy().tolist() for w in model.trainable_weights]


def _aggregation(average, local):
    """Horovod's gradient-aggregation check: a step that adds the gradient, four passes per
    step, ten calls in a tf.function; x's gradient is 1, y's [-(rank+1), 0] (through
    tf.gather: IndexedSlices).  With ``local`` the first half of the variables is local."""
    import tensorflow as tf
    from tensorflow import keras

    import hora.tensorflow.keras as hvd

    class Adding(keras.optimizers.Optimizer):
        def __init__(self, name, **kwargs):
            super().__init__(name=name, **kwargs)
            self._learning_rate = self._build_learning_rate(0.1)

        def update_step(self, gradient, variable):
            variable.assign_add(gradient)

    opt = hvd.DistributedOptimizer(Adding(name="adding"), backward_passes_per_step=4,
                                   average_aggregated_gradients=average, sparse_as_dense=True)
    xs = [tf.Variable([0.0]) for _ in range(4 if local else 1)]
    ys = [tf.Variable([1.0, 2.0]) for _ in range(4 if local else 1)]
    if local:
        for v in xs[:2] + ys[:2]:
            opt.register_local_var(v)
    scale = float(hvd.rank() + 1)

    def loss():
        return tf.add_n([x - scale * tf.gather(y, [0]) for x, y in zip(xs, ys)])

    @tf.function
    def step():
        opt.apply_gradients(opt._compute_gradients(loss, var_list=xs + ys))

    seen = []
    for _ in range(10):
        step()
        seen.append(([x.numpy().tolist() for x in xs], [y.numpy().tolist() for y in ys],
                     int(opt.iterations.numpy())))
    return seen, int(opt._agg_helper.counter.numpy())     # Horovod's name for the count


def _sec_aggregation():
    return {f"{avg}/{local}": _aggregation(avg, local)
            for avg in (True, False) for local in (False, True)}


def _sec_elastic_state():
    """Horovod's check of KerasState on a tf_keras model and optimizer: sync takes rank 0's
    weights and values, restore goes back to the last commit, commit keeps the new ones."""
    import tensorflow as tf

    import hora.tensorflow.keras as hvd
    r = hvd.rank()
    model = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(2,))])
    model.set_weights([np.full((2, 2), r + 1.0, np.float32), np.full(2, r + 1.0, np.float32)])
    opt = tf.keras.optimizers.legacy.Adam(0.01)
    state = hvd.elastic.KerasState(model, opt, batch=20 + r, epoch=10 + r)
    state.sync()
    synced = ([w.tolist() for w in model.get_weights()], state.batch, state.epoch,
              len(opt.variables()))
    model.set_weights([np.zeros((2, 2), np.float32), np.zeros(2, np.float32)])
    opt.iterations.assign(7)
    state.batch = 21
    state.restore()
    restored = ([w.tolist() for w in model.get_weights()], state.batch,
                int(opt.iterations.numpy()))
    model.set_weights([np.zeros((2, 2), np.float32), np.zeros(2, np.float32)])
    state.commit()
    state.restore()
    return synced, restored, [w.tolist() for w in model.get_weights()]


def _sec_infinite_gradient():
    """Horovod's check: an infinite gradient in the first step's passes does not reach the
    second step (the sums are zeroed, not subtracted)."""
    import tensorflow as tf

    import hora.tensorflow.keras as hvd
    count = tf.Variable(0)
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(), backward_passes_per_step=2,
                                   sparse_as_dense=True)
    x = tf.Variable(0.0)

    def loss():
        count.assign_add(1)
        return tf.cond(count > 1, lambda: x, lambda: x * float("inf"))

    grads = []
    for _ in range(4):
        pairs = opt._compute_gradients(loss, var_list=[x])
        opt.apply_gradients(pairs)
        grads.append(float(pairs[0][0].numpy()))
    return grads


def _sec_partial_and_sparse():
    """PartialDistributedOptimizer (first layer local) and a sparse gradient without
    sparse_as_dense (allgathered rows): the raw gradients and what the optimizer returns."""
    import tensorflow as tf
    from tensorflow import keras

    import hora.keras as hvd_keras
    import hora.tensorflow.keras as hvd
    r = hvd.rank()
    x, y = _data()
    model = _model(SEED + r)
    with tf.GradientTape(persistent=True) as tape:
        loss = keras.losses.mean_squared_error(y[:2], model(x[:2], training=True))
    raw = tape.gradient(loss, model.trainable_weights)
    opt = hvd_keras.PartialDistributedOptimizer(keras.optimizers.Adam(),
                                                local_layers=model.layers[0])
    got = opt._compute_gradients(loss, model.trainable_weights, tape=tape)
    table = tf.Variable(np.arange(6.0, dtype=np.float32).reshape(3, 2))
    sparse = hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(1.0))
    pairs = sparse._compute_gradients(
        lambda: tf.reduce_sum(tf.gather(table, [r]) * (r + 1.0)), var_list=[table])
    sparse.apply_gradients(pairs)
    return ([g.numpy().tolist() for g in raw], [g.numpy().tolist() for g, _ in got],
            type(pairs[0][0]).__name__, table.numpy().tolist())


def _sec_broadcast_local():
    """Horovod's check: non-trainable layers set to each rank's number; root = last rank;
    the first layer's variables are local."""
    import tensorflow as tf

    import hora.tensorflow.keras as hvd
    r, n = hvd.rank(), hvd.size()
    init = tf.keras.initializers.Constant(r)
    model = tf.keras.models.Sequential(
        [tf.keras.layers.Dense(3, input_shape=(3,), kernel_initializer=init,
                               bias_initializer=init, trainable=False)] +
        [tf.keras.layers.Dense(3, kernel_initializer=init, bias_initializer=init,
                               trainable=False) for _ in range(2)])
    model.compile(loss=tf.keras.losses.MSE, optimizer=tf.keras.optimizers.SGD())
    local = list(model.layers[0].variables)
    cb = hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank=n - 1, local_variables=local)
    model.fit(np.ones((1, 3)), np.ones((1, 3)), callbacks=[cb], verbose=0)
    return [(float(np.unique(v.numpy())[0]), any(v is x for x in local)) for v in model.variables]


def _sec_callbacks():
    """Raw and averaged logs; the learning rate each batch saw under the warm-up and a
    staircase schedule (legacy SGD with lr=, its momentum a variable, corrected and
    restored)."""
    from tensorflow import keras

    import hora.tensorflow.keras as hvd
    r, n = hvd.rank(), hvd.size()
    x, y = _data()
    raw, averaged, seen, momenta = [], [], [], []

    class Record(keras.callbacks.Callback):
        def __init__(self, into):
            super().__init__()
            self.into = into

        def on_epoch_end(self, epoch, logs=None):
            self.into.append(dict(logs))

    class Seen(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            opt = self.model.optimizer
            seen.append(float(keras.backend.get_value(opt.lr)))
            momenta.append(float(keras.backend.get_value(opt.momentum)))

    model = _model(SEED + r)                         # no broadcast: the losses differ
    opt = hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(lr=0.1, momentum=0.9))
    model.compile(optimizer=opt, loss=keras.losses.mean_squared_error, metrics=["mae"])
    hist = model.fit(
        _shard(x, r, n), _shard(y, r, n), batch_size=BATCH // n, epochs=4, verbose=0,
        shuffle=False,
        callbacks=[Record(raw), hvd.callbacks.MetricAverageCallback(), Record(averaged),
                   hvd.callbacks.LearningRateWarmupCallback(0.1 * n, warmup_epochs=2),
                   hvd.callbacks.LearningRateScheduleCallback(0.1 * n, 0.5, start_epoch=3),
                   Seen()])
    return raw, averaged, seen, momenta, hist.history["lr"], float(opt.momentum.numpy())


def _sec_checkpoint_and_load(tmp):
    """BestModelCheckpoint on rank 0 only; load_model of h5 and SavedModel files saved with a
    DistributedOptimizer, with a custom loss (custom_objects) and a custom optimizer class
    (custom_optimizers)."""
    import tensorflow as tf
    from tensorflow import keras

    import hora.tensorflow.keras as hvd
    from hora.keras.keras2 import _Distributed
    r, n = hvd.rank(), hvd.size()
    x, y = _data()

    def my_loss(a, b):
        return keras.losses.mean_squared_error(a, b)
    model = _model(SEED)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(lr=0.1,
                                                                                 momentum=0.9)),
                  loss=my_loss)
    best = os.path.join(tmp, f"rank{r}", "best.h5")
    model.fit(_shard(x, r, n), _shard(y, r, n), batch_size=BATCH // n, epochs=2, verbose=0,
              shuffle=False, validation_data=(_shard(x, r, n), _shard(y, r, n)),
              callbacks=[hvd.callbacks.BestModelCheckpoint(filepath=best)])
    out = {"written": os.path.exists(best)}
    paths = {"h5": os.path.join(tmp, "m.h5"), "savedmodel": os.path.join(tmp, "m_saved")}
    custom = os.path.join(tmp, "custom.h5")
    plain_cls = _plain_class()
    other = _model(SEED)
    other.compile(optimizer=hvd.DistributedOptimizer(plain_cls(0.1)), loss="mse")
    other.fit(_shard(x, r, n), _shard(y, r, n), batch_size=BATCH // n, epochs=1, verbose=0)
    if r == 0:
        model.save(paths["h5"])
        model.save(paths["savedmodel"], save_format="tf")
        other.save(custom)
    hvd.allreduce(0.0, name="saved")                 # a barrier: the files exist
    def state(optimizer):
        return (int(optimizer.iterations.numpy()),
                [float(np.abs(v.numpy()).sum()) for v in optimizer.variables()])
    for kind, path in paths.items():
        loaded = hvd.load_model(path, custom_objects={"my_loss": my_loss},
                                compression=hvd.Compression.fp16)
        o = loaded.optimizer
        restored = state(o)
        loaded.fit(_shard(x, r, n), _shard(y, r, n), batch_size=BATCH // n, epochs=1,
                   verbose=0, shuffle=False)
        out[kind] = (type(o).__name__, isinstance(o, _Distributed),
                     o._hora.reduce.compression.__name__, restored, int(o.iterations.numpy()),
                     [w.tolist() for w in loaded.get_weights()])
    # what tf_keras itself restores from a SavedModel, the optimizer unwrapped: nothing
    plain = keras.models.load_model(paths["savedmodel"], custom_objects={"my_loss": my_loss})
    out["plain_savedmodel"] = state(plain.optimizer)
    loaded = hvd.load_model(custom, custom_optimizers=[plain_cls])
    out["custom"] = (type(loaded.optimizer).__name__, isinstance(loaded.optimizer, _Distributed))
    del tf
    return out


def _sec_value_ops():
    import tensorflow as tf
    from tensorflow import keras

    import hora.tensorflow.keras as hvd
    r, n = hvd.rank(), hvd.size()
    mean = hvd.allreduce(tf.Variable([r, 2.0 * r])).numpy()
    total = hvd.allreduce(keras.backend.constant([float(r)]), op=hvd.Sum,
                          compression=hvd.Compression.fp16).numpy()
    gathered = hvd.allgather(np.full((r + 1, 2), r, np.int32)).numpy()
    root = hvd.broadcast(keras.backend.variable([r + 5.0]), n - 1).numpy()
    block = hvd.reducescatter(np.arange(2.0 * n) * (r + 1), op=hvd.Sum).numpy()
    return mean.tolist(), total.tolist(), gathered.tolist(), root.tolist(), block.tolist()


def _sec_graph_v1():
    """Horovod's v1 usage: a tf.compat.v1 graph and session set as Keras' own; fit with a
    legacy optimizer (lr=), the broadcast callback, hvd.broadcast_global_variables, and the
    value collectives returning values."""
    import tensorflow as tf
    from tensorflow import keras

    import hora.tensorflow.keras as hvd
    r, n = hvd.rank(), hvd.size()
    x, y = _data()
    out = {}
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        tf.compat.v1.keras.backend.set_session(sess)
        ref = _model(SEED)
        ref.compile(optimizer=keras.optimizers.legacy.SGD(lr=0.1, momentum=0.5),
                    loss=keras.losses.mean_squared_error)
        ref.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        model = _model(SEED + r)
        opt = hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(lr=0.1, momentum=0.5))
        model.compile(optimizer=opt, loss=keras.losses.mean_squared_error)
        model.fit(_shard(x, r, n), _shard(y, r, n), batch_size=BATCH // n, epochs=2,
                  shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                             hvd.callbacks.MetricAverageCallback()])
        out["eager"] = tf.executing_eagerly()
        out["diff"] = max(float(np.abs(a - b).max())
                          for a, b in zip(ref.get_weights(), model.get_weights()))
        v = tf.compat.v1.Variable([float(r)], name="apart")
        sess.run(v.initializer)
        hvd.broadcast_global_variables(1)
        out["broadcast"] = sess.run(v).tolist()
        out["allreduce"] = np.asarray(hvd.allreduce([float(r)], op=hvd.Sum)).tolist()
        out["allgather"] = np.asarray(hvd.allgather([[float(r)]])).tolist()
    keras.backend.clear_session()
    return out


def _worker(tmp):
    return run_sections({
        "equivalence": _sec_equivalence, "batchnorm": _sec_batchnorm,
        "aggregation": _sec_aggregation, "infinite_gradient": _sec_infinite_gradient,
        "elastic_state": _sec_elastic_state,
        "partial_and_sparse": _sec_partial_and_sparse, "broadcast_local": _sec_broadcast_local,
        "callbacks": _sec_callbacks, "checkpoint_and_load": lambda: _sec_checkpoint_and_load(tmp),
        "value_ops": _sec_value_ops, "graph_v1": _sec_graph_v1})


# -- the tests -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("keras2"))
    try:
        return run_ranks(_worker, 2, timeout_s=150, args=(tmp,), env=without(TF_EXTRAS, ENV))
    except Exception as e:  # noqa: BLE001 - reported by each test
        pytest.fail(f"the Keras 2 job failed: {e!r}")


def test_fit_on_shards_equals_one_process_on_the_whole_batch(job):
    results = section(job, "equivalence")
    refs = {key: weights for rank_refs, _ in results for key, weights in rank_refs.items()}
    assert sorted(refs) == REFERENCES
    for rank, (_, fits) in enumerate(results):
        for config, (weights, iterations, cls) in fits.items():
            kind, passes, _ = CONFIGS[config]
            diff = max(float(np.abs(a - b).max()) for a, b in zip(refs[kind, passes], weights))
            assert diff < TOL, f"rank {rank} {config}: weights off by {diff}"
            assert cls in ("SGD", "Adam", "Plain"), cls          # the optimizer's own class
            # Horovod's count with backward_passes_per_step: every apply_gradients call
            assert iterations == 2 * STEPS, (config, iterations)


def test_batchnorm_model_keeps_trainable_weights_equal(job):
    a, b = section(job, "batchnorm")
    assert a == b


def test_gradient_aggregation_as_horovod_expects(job):
    n, passes = 2, 4
    for key, (seen, counter) in section(job, "aggregation")[0].items():
        average, local = key.split("/")
        assert counter == len(seen) % passes, (key, counter)    # passes since the last step
        for idx, (xs, ys, iterations) in enumerate(seen):
            steps = (idx + 1) // passes
            gx, gy = steps * 1.0, steps * -(n + 1) / 2        # y: the mean of -(rank + 1)
            if average == "False":
                gx, gy = gx * passes, gy * passes
            for i, x in enumerate(xs):
                want = gx / n if local == "True" and i < 2 else gx
                assert x == pytest.approx([want]), (key, idx, i)
            for i, y in enumerate(ys):
                # rank 0's own y gradient is -1: local, divided by n
                want = gy / ((n + 1) / 2) / n if local == "True" and i < 2 else gy
                assert y == pytest.approx([1.0 + want, 2.0]), (key, idx, i)
            assert iterations == idx + 1


def test_elastic_keras_state_of_a_tf_keras_model(job):
    for synced, restored, committed in section(job, "elastic_state"):
        ones = [[[1.0, 1.0], [1.0, 1.0]], [1.0, 1.0]]
        zeros = [[[0.0, 0.0], [0.0, 0.0]], [0.0, 0.0]]
        assert synced == (ones, 20, 10, 5)          # iterations and m, v of 2: built first
        assert restored == (ones, 20, 0)
        assert committed == zeros


def test_infinite_gradient_does_not_outlive_its_step(job):
    for grads in section(job, "infinite_gradient"):
        assert np.isfinite(grads[-1]) and grads[-1] == pytest.approx(2.0)


def test_partial_keeps_local_layers_local_and_sparse_rows_are_gathered(job):
    results = section(job, "partial_and_sparse")
    n = len(results)
    for r, (raw, got, kind, table) in enumerate(results):
        for i, g in enumerate(got):
            if i < 2:                                            # the local layer
                np.testing.assert_allclose(g, np.array(raw[i]) / n, atol=1e-6)
            else:
                want = np.mean([np.array(res[0][i]) for res in results], axis=0)
                np.testing.assert_allclose(g, want, atol=1e-6)
        assert kind == "IndexedSlices"
        # rows 0 and 1 got (rank + 1) / n each, averaged from the gathered rows
        want = np.arange(6.0).reshape(3, 2)
        want[0] -= 1.0 / n
        want[1] -= 2.0 / n
        np.testing.assert_allclose(table, want, atol=1e-6)


def test_broadcast_callback_leaves_local_variables_alone(job):
    for r, values in enumerate(section(job, "broadcast_local")):
        for value, is_local in values:
            assert value == (float(r) if is_local else 1.0)


def test_callbacks_average_metrics_and_schedule_the_learning_rate(job):
    results = section(job, "callbacks")
    n = len(results)
    raws = [res[0] for res in results]
    for _, averaged, seen, momenta, logged, momentum in results:
        for epoch in range(4):
            for key in ("loss", "mae"):
                want = np.mean([raw[epoch][key] for raw in raws])
                assert averaged[epoch][key] == pytest.approx(want, rel=1e-6)
        want = []
        for epoch in range(4):
            for batch in range(STEPS):
                e = epoch + (batch + 1) / STEPS
                if epoch < 2:
                    want.append(0.1 * n / n * (e * (n - 1) / 2 + 1))
                elif epoch < 3:
                    want.append(want[-1])
                else:
                    want.append(0.1 * n * 0.5 ** (epoch - 3))
        assert seen == pytest.approx(want, rel=1e-5)
        assert logged[-1] == pytest.approx(want[-1], rel=1e-5)
        # momentum corrected while the rate changes (a legacy optimizer's is a variable)
        assert any(abs(m - 0.9) > 1e-6 for m in momenta) and momentum == pytest.approx(0.9)
    assert raws[0][0]["loss"] != raws[1][0]["loss"]


def test_checkpoint_on_rank0_and_load_model_rewraps(job):
    results = section(job, "checkpoint_and_load")
    assert [res["written"] for res in results] == [True, False]
    for kind in ("h5", "savedmodel"):
        for res in results:
            name, wrapped, compression, restored, iterations, _ = res[kind]
            assert (name, wrapped, compression) == ("SGD", True, "FP16Compressor")
            if kind == "h5":                   # saved 8 steps and the momentum, then one epoch
                assert restored[0] == 2 * STEPS and sum(restored[1]) > 0, (kind, restored)
                assert iterations == 2 * STEPS + STEPS, (kind, iterations)
            else:                              # tf_keras restores no optimizer state from a
                assert restored == res["plain_savedmodel"] == (0, [0.0])  # SavedModel: nor we
                assert iterations == STEPS, (kind, iterations)
        assert results[0][kind][5] == results[1][kind][5]
    assert [res["custom"] for res in results] == [("Plain", True)] * 2


def test_value_collectives_on_tf_keras_values(job):
    for r, (mean, total, gathered, root, block) in enumerate(section(job, "value_ops")):
        assert mean == [0.5, 1.0]
        assert total == [1.0]
        assert gathered == [[0, 0], [1, 1], [1, 1]]
        assert root == [6.0]
        full = np.arange(4.0) * 1 + np.arange(4.0) * 2
        assert block == full[2 * r:2 * r + 2].tolist()


def test_tf_compat_v1_graph_with_a_session(job):
    for res in section(job, "graph_v1"):
        assert res["eager"] is False
        assert res["diff"] < TOL
        assert res["broadcast"] == [1.0]
        assert res["allreduce"] == [1.0]
        assert res["allgather"] == [[0.0], [1.0]]


def test_keras2_digits_example_trains_and_writes_on_rank0_only(tmp_path):
    pytest.importorskip("sklearn")
    env = dict(os.environ, **without(("jax", "jaxlib", "pandas", "matplotlib"), ENV))
    accuracy, _ = run_digits_example("keras2_digits.py", tmp_path, 3, env)
    assert accuracy > 0.9
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        f"digits-{e:02d}.h5" for e in range(1, 4)]
