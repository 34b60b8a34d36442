"""Elastic states and callbacks for TensorFlow and Keras in one process (size 1):
hvd.elastic.TensorFlowState, TensorFlowKerasState, KerasState, the three Keras callbacks, and
run's reading of a TensorFlow error that names a failed rank.

Keras runs here on its TensorFlow backend (hora.keras.elastic itself is written once for
every backend; tests/multiproc/test_tf_keras_elastic_state.py runs it on the others).  The
expected values are NumPy copies the test takes itself, never the state's own copies.
"""
import os

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
if keras.backend.backend() != "tensorflow":
    pytest.skip("these tests run Keras on its TensorFlow backend", allow_module_level=True)

import hora.keras as hk  # noqa: E402
import hora.tensorflow as hvd  # noqa: E402

FEATURES, CLASSES = 4, 3
STEPS, BATCH = 5, 4                  # one epoch: STEPS batches of BATCH rows


@pytest.fixture
def alone():
    hvd.init()
    yield
    hvd.shutdown()


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((STEPS * BATCH, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, STEPS * BATCH)
    return x, y


def _model(seed=1):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(6, activation="tanh"),
                              keras.layers.BatchNormalization(), keras.layers.Dense(CLASSES)])
    model.compile(optimizer=keras.optimizers.Adam(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _fit(model, steps, seed=0):
    x, y = _data(seed)
    model.fit(x[:steps * BATCH], y[:steps * BATCH], batch_size=BATCH, epochs=1, shuffle=False,
              verbose=0)


def _np(v):
    return np.array(tf.convert_to_tensor(v).numpy(), copy=True)


def _values(variables):
    return [_np(v) for v in variables]


def _assert_equal(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(_np(g), e)


def _differs(got, expected):
    return any(not np.array_equal(_np(g), e) for g, e in zip(got, expected))


# -- TensorFlowState ---------------------------------------------------------------------------
def test_tensorflow_state_commit_and_restore_round_trip(alone):
    weights = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3))
    steps = tf.Variable(np.int64(0))
    state = hvd.elastic.TensorFlowState([weights, steps], epoch=0)
    first = _values([weights, steps])

    weights.assign_add(tf.ones((2, 3)))
    steps.assign_add(1)
    state.epoch = 1
    state.restore()                                    # back to the constructor's commit
    _assert_equal([weights, steps], first)
    assert state.epoch == 0

    weights.assign(weights * 3.0)
    steps.assign(7)
    state.epoch = 2
    state.commit()
    committed = _values([weights, steps])
    for _ in range(2):                                 # twice: the commit is not used up
        weights.assign_add(tf.fill((2, 3), 0.5))
        steps.assign_add(5)
        state.epoch = 9
        state.restore()
        _assert_equal([weights, steps], committed)
        assert state.epoch == 2


def test_tensorflow_state_sync_alone_commits_the_current_values(alone):
    v = tf.Variable([1.0, 2.0])
    state = hvd.elastic.TensorFlowState([v])
    v.assign([3.0, 4.0])
    state.sync()                                       # rank 0's current values, committed
    v.assign([5.0, 6.0])
    state.restore()
    np.testing.assert_array_equal(v.numpy(), [3.0, 4.0])
    assert hvd.elastic.TensorFlowState().variables == []


def test_tensorflow_state_refuses_tf1_sessions(alone):
    with pytest.raises(NotImplementedError, match="session"):
        hvd.elastic.TensorFlowState([tf.Variable(1.0)], session=object())
    with tf.Graph().as_default():
        with pytest.raises(NotImplementedError, match="graph"):
            hvd.elastic.TensorFlowState([])


def test_elastic_names_match_horovods():
    assert {"run", "State", "ObjectState", "TensorFlowState",
            "TensorFlowKerasState"} <= set(dir(hvd.elastic))
    import hora.tensorflow.keras as tk
    assert {"run", "KerasState", "TensorFlowKerasState", "CommitStateCallback",
            "UpdateBatchStateCallback", "UpdateEpochStateCallback"} <= set(dir(tk.elastic))
    assert hk.elastic.KerasState is tk.elastic.KerasState
    assert "elastic" in hvd.__all__ and "elastic" in hk.__all__


# -- KerasState / TensorFlowKerasState ---------------------------------------------------------
STATES = {"KerasState": lambda *a, **k: hk.elastic.KerasState(*a, **k),
          "TensorFlowKerasState": lambda *a, **k: hvd.elastic.TensorFlowKerasState(*a, **k)}


@pytest.mark.parametrize("kind", sorted(STATES))
def test_keras_state_restores_committed_weights_and_optimizer_slots(alone, kind):
    model = _model()
    _fit(model, 2)
    opt = model.optimizer
    state = STATES[kind](model, epoch=3)
    weights, slots = _values(model.weights), _values(opt.variables)
    assert int(opt.iterations.numpy()) == 2

    _fit(model, 3, seed=1)                             # weights, moments and count move on
    assert _differs(model.weights, weights) and _differs(opt.variables, slots)
    state.epoch = 4
    state.restore()
    _assert_equal(model.weights, weights)              # BatchNorm's moving stats included
    _assert_equal(opt.variables, slots)
    assert int(opt.iterations.numpy()) == 2 and state.epoch == 3

    _fit(model, 1)
    state.commit()
    weights, slots = _values(model.weights), _values(opt.variables)
    _fit(model, 2, seed=2)
    state.restore()
    _assert_equal(model.weights, weights)
    _assert_equal(opt.variables, slots)
    assert int(opt.iterations.numpy()) == 3


@pytest.mark.parametrize("kind", sorted(STATES))
def test_keras_state_builds_the_optimizer_so_a_restore_clears_later_slots(alone, kind):
    model = _model()
    opt = model.optimizer
    assert not opt.built                               # Keras 3: slots come with the 1st step
    weights = _values(model.weights)
    state = STATES[kind](model)
    assert opt.built
    n_slots = 2 + 2 * len(model.trainable_weights)     # iteration, lr, Adam's 2 per weight
    assert len(opt.variables) == n_slots
    _fit(model, 2)
    state.restore()
    _assert_equal(model.weights, weights)
    assert int(opt.iterations.numpy()) == 0
    for v in opt.variables[2:]:
        assert not np.any(_np(v))               # the moments are zeros again


@pytest.mark.parametrize("kind", sorted(STATES))
def test_keras_state_needs_a_built_model(kind):
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="build the model"):
        STATES[kind](unbuilt)


@pytest.mark.parametrize("kind", sorted(STATES))
def test_keras_state_of_an_uncompiled_model_keeps_its_weights(alone, kind):
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(2)])
    state = STATES[kind](model)                        # no optimizer yet
    weights = _values(model.weights)
    model.layers[0].kernel.assign(tf.zeros((FEATURES, 2)))
    state.restore()
    _assert_equal(model.weights, weights)


# -- the callbacks -----------------------------------------------------------------------------
class _Counting(hk.elastic.KerasState):
    """Records (batch, epoch) at each commit, and the weights then."""

    def commit(self):
        self.commits.append((self.batch, self.epoch))
        super().commit()


class _Steps(keras.callbacks.Callback):
    """Records ``params["steps"]`` at each epoch's start (after UpdateBatchStateCallback)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_begin(self, epoch, logs=None):
        self.seen.append(self.params["steps"])


def test_callbacks_update_batch_and_epoch_and_commit_every_n_batches(alone):
    model = _model()
    state = _Counting(model, batch=0, epoch=0)
    state.commits = []
    steps = _Steps()
    callbacks = [hk.elastic.UpdateEpochStateCallback(state),
                 hk.elastic.UpdateBatchStateCallback(state),
                 hk.elastic.CommitStateCallback(state, batches_per_commit=2), steps]
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    # 5 batches an epoch, a commit after every 2nd batch (the count runs on over the epoch's
    # end) and one at each epoch's end, where the epoch is already counted and batch is 0
    assert state.commits == [(1, 0), (3, 0), (0, 1), (0, 1), (2, 1), (4, 1), (0, 2)]
    assert (state.batch, state.epoch) == (0, 2)
    assert steps.seen == [STEPS, STEPS]
    final = _values(model.weights)
    _fit(model, 1, seed=3)
    state.restore()                                    # the epoch-end commit: the fit's end
    _assert_equal(model.weights, final)

    # a second fit (after a reset): the count starts again, epochs go on from state.epoch,
    # and an epoch resumed at state.batch shows the batches left as its steps
    state.commits = []
    state.batch = 2
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    assert state.commits == [(1, 2), (3, 2), (0, 3)]
    assert steps.seen[-1] == STEPS - 2
    assert (state.batch, state.epoch) == (0, 3)


def test_commit_callback_rejects_zero_batches():
    state = hk.elastic.ObjectState(lambda obj: obj, lambda: 0)
    with pytest.raises(ValueError, match="batches_per_commit"):
        hk.elastic.CommitStateCallback(state, batches_per_commit=0)


# -- run ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("module", ["tensorflow", "keras"])
def test_run_treats_a_tf_error_naming_a_failed_rank_as_one(alone, module):
    elastic = hvd.elastic if module == "tensorflow" else hk.elastic
    v = tf.Variable([1.0])
    state = hvd.elastic.TensorFlowState([v], epoch=0)
    calls = []

    @elastic.run
    def train(state):
        calls.append((float(v.numpy()[0]), state.epoch))
        if len(calls) == 1:
            v.assign([9.0])
            state.epoch = 5
            raise tf.errors.UnknownError(None, None, "Error in PyFunc: hora.errors."
                                         "HoraRankFailedError: rank 1 died")
        return "done"

    assert train(state) == "done"
    assert calls == [(1.0, 0), (1.0, 0)]              # the second call saw the restore

    @elastic.run
    def broken(state):
        raise tf.errors.UnknownError(None, None, "something else")

    with pytest.raises(tf.errors.UnknownError, match="something else"):
        broken(state)
