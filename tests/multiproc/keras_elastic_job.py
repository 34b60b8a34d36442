"""The elastic states' sections of test_keras.py's jobs (they run in its ranks) and their checks.

Every rank starts from its own weights and optimizer state (its own seed, learning rate and
number of steps), commits, syncs, then trains on alone and restores; each rank's values after
the sync and after the restore must be what rank 0 reported before the sync.  The data's shape
is test_keras.py's (read when a section runs: that module imports this one).
"""
import numpy as np


def _k():
    from tests.multiproc import test_keras
    return test_keras


def _numpy(variables):
    import keras
    return [keras.ops.convert_to_numpy(keras.ops.copy(v)).tolist() for v in variables]


def _steps(model, count, seed, callbacks=()):
    """``count`` batches of fresh data from ``seed``."""
    k, rng = _k(), np.random.default_rng(seed)
    x = rng.standard_normal((count * k.BATCH, k.FEATURES)).astype(np.float32)
    y = rng.integers(0, k.CLASSES, count * k.BATCH)
    model.fit(x, y, batch_size=k.BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=list(callbacks))


def _trained_model(r):
    """A model with rank r's own start, optimizer and r + 1 Adam steps on its own data."""
    import keras
    keras.utils.set_random_seed(100 + r)
    k = _k()
    model = keras.Sequential([keras.Input((k.FEATURES,)), keras.layers.Dense(5, activation="tanh"),
                              keras.layers.BatchNormalization(), keras.layers.Dense(k.CLASSES)])
    model.compile(optimizer=keras.optimizers.Adam(0.01 * (r + 1)), jit_compile=k._jit(),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    _steps(model, r + 1, seed=r)
    return model


def model_state(make_state):
    """A model state's values: before and after sync(), after training alone, after
    restore(); then through fit with the elastic callbacks."""
    import keras

    import hora.keras as hvd
    r = hvd.rank()
    model = _trained_model(r)
    opt = model.optimizer
    state = make_state(model, epoch=10 + r, batch=0, info={"rank": r})
    state.commit()

    def values():
        return dict(weights=_numpy(model.weights), optimizer=_numpy(opt.variables))
    before = values()
    state.epoch = 99                                  # not committed: sync ignores it
    state.sync()
    after = values()
    _steps(model, 2, seed=50 + r)                     # alone again: the ranks drift apart
    drifted = values()
    state.restore()                                   # sync committed rank 0's values
    restored, epoch = values(), state.epoch
    # fit with the callbacks: the commit after its first batch holds the weights then (on
    # JAX, fit keeps them outside the variables between steps) and so does the one at its end

    class Probe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                self.now = _numpy(self.model.weights)        # self.model: brought up to date
                state.restore()
                self.committed = _numpy(model.weights)       # model: as restore() left it

    probe = Probe()
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state), probe]
    _steps(model, 2, seed=70 + r, callbacks=callbacks)
    fitted = values()
    _steps(model, 1, seed=80 + r)
    state.restore()
    return dict(before=before, after=after, drifted=drifted, restored=restored,
                epoch=epoch, info=state.info, fitted=fitted, fitted_restored=values(),
                fitted_epoch=state.epoch, probe=(probe.now, probe.committed))


def sec_keras_state():
    import hora.keras as hvd
    return model_state(hvd.elastic.KerasState)


def sec_tf_keras_state():
    import hora.tensorflow.keras as hvd
    return model_state(hvd.elastic.TensorFlowKerasState)


def sec_tf_state():
    import tensorflow as tf

    import hora.tensorflow as hvd
    r = hvd.rank()
    a = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3) * (r + 1))
    b = tf.Variable(np.int64(100 + r))
    state = hvd.elastic.TensorFlowState([a, b], epoch=10 + r)
    state.commit()
    before = [a.numpy().tolist(), int(b.numpy())]
    state.epoch = 99
    state.sync()
    after = [a.numpy().tolist(), int(b.numpy())]
    a.assign_add(tf.ones((2, 3)))
    b.assign(7)
    state.restore()
    return dict(before=before, after=after, restored=[a.numpy().tolist(), int(b.numpy())],
                epoch=state.epoch)



def check_model_state(results):
    """Every rank holds rank 0's committed model after sync() and restore() (a
    :func:`model_state` from each rank)."""
    root = results[0]["before"]
    for part in ("weights", "optimizer"):
        assert results[1]["before"][part] != root[part]           # they did differ
        assert results[1]["drifted"][part] != root[part]          # and drifted again
    assert root["optimizer"][0] == 1                              # rank 0 took 1 step
    assert results[1]["before"]["optimizer"][0] == 2              # rank 1 took 2
    for rank, res in enumerate(results):
        for part in ("weights", "optimizer"):
            for got, want in zip(res["after"][part], root[part]):
                np.testing.assert_array_equal(got, want, err_msg=f"rank {rank} {part}")
            for got, want in zip(res["restored"][part], root[part]):
                np.testing.assert_array_equal(got, want, err_msg=f"rank {rank} {part}")
            assert len(res["after"][part]) == len(root[part])
        assert (res["epoch"], res["info"]) == (10, {"rank": 0})
        assert res["fitted"] != res["restored"]
        assert res["fitted_restored"] == res["fitted"]
        assert res["fitted_epoch"] == 11
        now, committed = res["probe"]
        assert committed == now and now != res["restored"]["weights"]


def check_tf_state(results):
    """Every rank holds rank 0's committed variables after sync() and restore()."""
    root = results[0]["before"]
    assert root == [[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], 100]     # what rank 0 started with
    assert results[1]["before"] == [[[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]], 101]
    for res in results:
        assert res["after"] == root
        assert res["restored"] == root
        assert res["epoch"] == 10
