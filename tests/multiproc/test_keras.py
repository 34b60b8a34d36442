"""hora.keras (and hora.tensorflow.keras) on real ranks, on Keras' TensorFlow, torch and JAX
backends (JAX's train step compiled with ``jax.jit``, the others' as hora's README says).

The oracle for training is one process fitting the whole batch: every rank builds the global
data from a fixed seed, fits its share of the reference copies of the model on all of it
without hora, fits its own copy on its shard with ``DistributedOptimizer`` (starting from its
own random weights, which ``BroadcastGlobalVariablesCallback`` replaces with rank 0's), and
reports both sets of weights; the test compares every rank's copy with the reference.
Callbacks are checked against what the test computes from every rank's raw numbers.

The elastic states' ``sync()`` is checked here too: every rank starts from its own weights and
optimizer state (its own seed, learning rate and number of steps), commits, syncs, then trains
on alone and restores; each rank's values after the sync and after the restore must be what
rank 0 reported before the sync (hora.keras.elastic on every backend; TensorFlowState and
TensorFlowKerasState on the tensorflow one; their sections and checks: keras_elastic_job.py).

One job per backend runs every section (Keras takes seconds to import).  The JAX job runs
without TensorFlow, as ``pip install "hora[jax]" keras`` has it: hora.keras imports
TensorFlow only on its own backend, and Keras on JAX would import it only to save a file.
The torch job keeps it: its last section checks that hora.tensorflow.keras refuses Keras on
torch.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("keras")     # TensorFlow: by each test that needs it (the JAX job has none)

from tests.helpers import (TF_EXTRAS, cached, keras_extras, run_digits_example,  # noqa: E402
                           run_ranks, run_sections, section, without)
from tests.multiproc import keras_elastic_job  # noqa: E402

SEED = 7
BATCH = 8                     # the global batch, split evenly among the ranks
STEPS = 4                     # batches per epoch
FEATURES, CLASSES = 5, 3
TOL = 2e-5


# -- everything below runs in the workers --------------------------------------------------
def _jit():
    """``jit_compile`` for compile(): on JAX the train step runs under ``jax.jit`` (hora's
    collectives are host callbacks there); TensorFlow's stays a graph without XLA."""
    import keras
    return keras.backend.backend() == "jax"


def _data():
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((STEPS * BATCH, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, STEPS * BATCH)
    return x, y


def _shard(a, r, n):
    """Rank r's rows of every global batch, in batch order."""
    per = BATCH // n
    return a.reshape(STEPS, BATCH, *a.shape[1:])[:, r * per:(r + 1) * per].reshape(
        -1, *a.shape[1:])


def _model(keras, seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(CLASSES)])
    return model


def _optimizer(keras, kind):
    return keras.optimizers.Adam(0.01) if kind == "adam" else keras.optimizers.SGD(0.1, 0.5)


# the distributed fits, as (optimizer, backward passes per step, groups)
CONFIGS = [("sgd", 1, None), ("adam", 1, None), ("adam", 2, None), ("sgd", 1, "int"),
           ("adam", 1, "list")]
# the one-process fits they are compared with: groups change nothing in one process, so the
# configs that differ only in them share one
REFERENCES = sorted({(kind, passes) for kind, passes, _ in CONFIGS})


def _reference(kind, passes):
    """Rank 0's start fitted on the whole batch in this process alone, without hora."""
    import keras
    x, y = _data()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ref = _model(keras, SEED)
    ref.compile(optimizer=_optimizer(keras, kind), loss=loss, jit_compile=_jit())
    ref.fit(x, y, batch_size=BATCH * passes, epochs=2, shuffle=False, verbose=0)
    return [np.asarray(w) for w in ref.get_weights()]


def _distributed(kind, passes, groups):
    """Every rank's own start, fitted on its shard with DistributedOptimizer."""
    import keras

    import hora.keras as hvd
    r, n = hvd.rank(), hvd.size()
    x, y = _data()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    dist = _model(keras, SEED + r)
    options = {"backward_passes_per_step": passes, "average_aggregated_gradients": passes > 1}
    if groups == "int":
        options["groups"] = 2
    elif groups == "list":
        options["groups"] = [[dist.layers[1].kernel, dist.layers[0].bias]]
    opt = hvd.DistributedOptimizer(_optimizer(keras, kind), **options)
    dist.compile(optimizer=opt, loss=loss, jit_compile=_jit())
    dist.fit(_shard(x, r, n), _shard(y, r, n), batch_size=BATCH // n, epochs=2, shuffle=False,
             verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    return ([np.asarray(w) for w in dist.get_weights()],
            int(keras.ops.convert_to_numpy(opt.iterations)))


def _sec_equivalence():
    """Rank r fits the references whose index is r modulo the size (each is fitted once, a
    reference being the same computation on every rank), then every config."""
    import hora.keras as hvd
    r, n = hvd.rank(), hvd.size()
    refs = {ref: _reference(*ref) for i, ref in enumerate(REFERENCES) if i % n == r}
    return refs, {config: _distributed(*config) for config in CONFIGS}


def _sec_broadcast_callback():
    """Rank-dependent weights and optimizer state; the callback gives everyone rank 0's."""
    import keras

    import hora.keras as hvd
    r = hvd.rank()
    model = _model(keras, SEED + 100 + r)
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))
    model.compile(optimizer=opt, loss="mse", jit_compile=_jit())
    opt.build(model.trainable_variables)
    for v in opt.variables:
        v.assign(keras.ops.ones(v.shape, v.dtype) * (r + 1))
    before = ([w.tolist() for w in model.get_weights()],
              [keras.ops.convert_to_numpy(v).tolist() for v in opt.variables])
    cb = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
    cb.set_model(model)
    cb.on_train_begin()
    after = ([w.tolist() for w in model.get_weights()],
             [keras.ops.convert_to_numpy(v).tolist() for v in opt.variables])
    return before, after


def _sec_metric_average():
    """Raw logs (recorded before the averaging callback) and averaged ones (after it)."""
    import keras

    import hora.keras as hvd
    r, n = hvd.rank(), hvd.size()
    x, y = _data()
    raw, averaged = [], []

    class Record(keras.callbacks.Callback):
        def __init__(self, into):
            super().__init__()
            self.into = into

        def on_epoch_end(self, epoch, logs=None):
            self.into.append(dict(logs))
    model = _model(keras, SEED + r)                 # no broadcast: the ranks' losses differ
    model.compile(optimizer=keras.optimizers.SGD(0.0), jit_compile=_jit(), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(_shard(x, r, n), _shard(y, r, n), batch_size=BATCH // n, epochs=2, verbose=0,
              shuffle=False, callbacks=[Record(raw), hvd.callbacks.MetricAverageCallback(),
                                        Record(averaged)])
    return raw, averaged


def _sec_metric_mismatch():
    """Validation data on rank 0 only: every rank gets the same clear error."""
    import keras

    import hora.keras as hvd
    r, n = hvd.rank(), hvd.size()
    x, y = _data()
    model = _model(keras, SEED)
    model.compile(optimizer=keras.optimizers.SGD(0.0), jit_compile=_jit(),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    try:
        model.fit(_shard(x, r, n), _shard(y, r, n), batch_size=BATCH // n, epochs=1, verbose=0,
                  validation_data=(x[:4], y[:4]) if r == 0 else None,
                  callbacks=[hvd.callbacks.MetricAverageCallback()])
    except Exception as e:  # noqa: BLE001 - the test checks what it was
        return type(e).__name__, str(e)
    return None


def _sec_warmup():
    """The learning rate each batch saw, with LearningRateWarmupCallback."""
    import keras

    import hora.keras as hvd
    r, n = hvd.rank(), hvd.size()
    x, y = _data()
    seen = []

    class Seen(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))
    model = _model(keras, SEED)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=_jit())
    warmup = hvd.callbacks.LearningRateWarmupCallback(0.1 * n, warmup_epochs=2,
                                                      momentum_correction=False)
    hist = model.fit(_shard(x, r, n), _shard(y, r, n), batch_size=BATCH // n, epochs=3,
                     verbose=0, shuffle=False, callbacks=[warmup, Seen()])
    return seen, hist.history["lr"]


def _sec_checkpoint_and_load(tmp):
    """BestModelCheckpoint writes on rank 0 only; load_model gives a wrapped optimizer back,
    with its options and state, from a wrapped save and from a plain one."""
    import keras

    import hora.keras as hvd
    r, n = hvd.rank(), hvd.size()
    x, y = _data()
    model = _model(keras, SEED)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), backward_passes_per_step=2)
    model.compile(optimizer=opt, loss=loss, jit_compile=_jit())
    best = os.path.join(tmp, f"rank{r}", "best.keras")
    model.fit(_shard(x, r, n), _shard(y, r, n), batch_size=BATCH // n, epochs=2, verbose=0,
              shuffle=False, validation_data=(_shard(x, r, n), _shard(y, r, n)),
              callbacks=[hvd.callbacks.BestModelCheckpoint(filepath=best)])
    written = os.path.exists(best)
    wrapped_path = os.path.join(tmp, "wrapped.keras")
    plain_path = os.path.join(tmp, "plain.keras")
    if r == 0:
        model.save(wrapped_path)
        plain = _model(keras, SEED)
        plain.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss, jit_compile=_jit())
        plain.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        plain.save(plain_path)
    hvd.allreduce(0.0, name="saved")                 # a barrier: the files exist
    out = {"written": written}
    for name, path in (("wrapped", wrapped_path), ("plain", plain_path)):
        loaded = hvd.load_model(path)
        o = loaded.optimizer
        before = [np.asarray(w) for w in loaded.get_weights()]
        loaded.fit(_shard(x, r, n), _shard(y, r, n), batch_size=BATCH // n, epochs=1,
                   verbose=0, shuffle=False)
        moved = max(float(np.abs(a - b).max()) for a, b in zip(before, loaded.get_weights()))
        out[name] = (type(o).__name__, o.backward_passes_per_step,
                     type(o.inner_optimizer).__name__,
                     int(keras.ops.convert_to_numpy(o.iterations)), moved,
                     [w.tolist() for w in loaded.get_weights()])
    return out


def _sec_scalar_ops():
    import keras

    import hora.keras as hvd
    r, n = hvd.rank(), hvd.size()
    mean = keras.ops.convert_to_numpy(hvd.allreduce(np.array([r, 2.0 * r], np.float32)))
    total = keras.ops.convert_to_numpy(hvd.allreduce([float(r)], op=hvd.Sum,
                                                     compression=hvd.Compression.fp16))
    gathered = keras.ops.convert_to_numpy(hvd.allgather(np.full((r + 1, 2), r, np.int32)))
    root = keras.ops.convert_to_numpy(hvd.broadcast(np.array([r + 5.0]), n - 1))
    block = keras.ops.convert_to_numpy(hvd.reducescatter(np.arange(2.0 * n) * (r + 1),
                                                         op=hvd.Sum))
    return mean.tolist(), total.tolist(), gathered.tolist(), root.tolist(), block.tolist()


def _sec_partial():
    """One step of PartialDistributedOptimizer with the first layer local, and the same
    step taken alone with the wrapped optimizer (the test combines the ranks' plain steps)."""
    import keras

    import hora.keras as hvd
    r, n = hvd.rank(), hvd.size()
    x, y = _data()
    x, y = _shard(x, r, n)[:BATCH // n], _shard(y, r, n)[:BATCH // n]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    out = {}
    for name, wrap in (("plain", lambda o, m: o),
                       ("partial", lambda o, m: hvd.PartialDistributedOptimizer(
                           o, local_layers=m.layers[0]))):
        model = _model(keras, SEED)
        w0 = [w.tolist() for w in model.get_weights()]
        model.compile(optimizer=wrap(keras.optimizers.SGD(0.5), model), loss=loss,
                      jit_compile=_jit())
        model.fit(x, y, batch_size=len(x), epochs=1, verbose=0, shuffle=False)
        out[name] = [w.tolist() for w in model.get_weights()]
    return w0, out["plain"], out["partial"]


def _sec_tensorflow_keras_refused():
    """``import hora.tensorflow.keras`` with Keras on torch: what it raised.  Last of the
    torch job's sections, as it imports hora.tensorflow into the process."""
    try:
        import hora.tensorflow.keras  # noqa: F401
    except Exception as e:  # noqa: BLE001 - the test checks what it was
        return type(e).__name__, str(e)
    return None


def _worker(tmp):
    import keras
    sections = {"equivalence": _sec_equivalence, "broadcast_callback": _sec_broadcast_callback,
                "metric_average": _sec_metric_average, "warmup": _sec_warmup,
                "checkpoint_and_load": lambda: _sec_checkpoint_and_load(tmp),
                "scalar_ops": _sec_scalar_ops, "partial": _sec_partial,
                "keras_state": keras_elastic_job.sec_keras_state}
    backend = keras.backend.backend()
    if backend == "tensorflow":
        sections.update(metric_mismatch=_sec_metric_mismatch,
                        tf_keras_state=keras_elastic_job.sec_tf_keras_state,
                        tf_state=keras_elastic_job.sec_tf_state)
    elif backend == "torch":
        sections.update(tensorflow_keras_refused=_sec_tensorflow_keras_refused)
    return run_sections(sections)


# -- the tests -----------------------------------------------------------------------------
BACKENDS = ["tensorflow", "torch", "jax"]
# what each backend's job hides (tests/without): the packages TensorFlow and Keras import when
# they find them, but the backend's own; the JAX job goes without TensorFlow as well
HIDDEN = {"tensorflow": keras_extras("tensorflow"), "torch": keras_extras("torch"),
          "jax": keras_extras("jax") + ("tensorflow", "tensorboard")}
# how each backend's ranks compute, for models this small.  torch: one thread a rank, as
# hora's examples pin it (keras_digits.py's pin_devices); its default pool of a thread a
# core only spins while two ranks share the cores (about 3 s of CPU a job).  JAX: XLA
# compiles the train steps without its backend optimizations, which cost more compile time
# than they save in a few steps (about 4.5 s of CPU a job; the results still equal the
# reference's, fitted the same way).  TensorFlow as it comes: its pools of one thread
# saved only 0.5 s of CPU, and one inter-op thread can deadlock a graph whose collectives
# wait for each other (test_tf_training.py's jobs hang with TF_NUM_INTEROP_THREADS=1).
COMPUTE = {"tensorflow": {}, "torch": {"OMP_NUM_THREADS": "1"},
           "jax": {"XLA_FLAGS": "--xla_backend_optimization_level=0"}}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    cache = {}

    def run(backend):
        tmp = str(tmp_path_factory.mktemp(f"keras-{backend}"))
        return run_ranks(_worker, 2, timeout_s=240, args=(tmp,),
                         env=without(HIDDEN[backend], {"KERAS_BACKEND": backend,
                                                       "TF_CPP_MIN_LOG_LEVEL": "3",
                                                       **COMPUTE[backend]}))

    def get(backend):
        pytest.importorskip(backend)
        return cached(cache, backend, lambda: run(backend), f"the {backend} job")
    return get


@pytest.mark.parametrize("backend", BACKENDS)
def test_fit_on_shards_equals_one_process_on_the_whole_batch(jobs, backend):
    results = section(jobs(backend), "equivalence")
    refs = {key: weights for rank_refs, _ in results for key, weights in rank_refs.items()}
    assert sorted(refs) == REFERENCES
    for rank, (_, fits) in enumerate(results):
        for (kind, passes, groups), (weights, iterations) in fits.items():
            config = f"{kind}/passes{passes}/{groups}"
            diff = max(float(np.abs(a - b).max()) for a, b in zip(refs[kind, passes], weights))
            assert diff < TOL, f"{backend} rank {rank} {config}: weights off by {diff}"
            assert iterations == 2 * STEPS // passes, (config, iterations)


@pytest.mark.parametrize("backend", BACKENDS)
def test_broadcast_callback_gives_rank0_weights_and_optimizer_state(jobs, backend):
    results = section(jobs(backend), "broadcast_callback")
    root_before = results[0][0]
    assert results[1][0] != root_before                # the ranks did start apart
    for before, after in results:
        assert after == root_before


@pytest.mark.parametrize("backend", BACKENDS)
def test_metric_average_logs_the_mean_over_ranks(jobs, backend):
    results = section(jobs(backend), "metric_average")
    raws = [raw for raw, _ in results]
    for epoch in range(2):
        for key in ("loss", "accuracy"):
            want = np.mean([raw[epoch][key] for raw in raws])
            for _, averaged in results:
                assert averaged[epoch][key] == pytest.approx(want, rel=1e-6)
    assert raws[0][0]["loss"] != raws[1][0]["loss"]


def test_metric_average_names_ranks_that_validate_alone(jobs):
    results = section(jobs("tensorflow"), "metric_mismatch")
    for kind, message in results:
        assert kind == "CollectiveMismatchError"
        assert "rank 0: loss, val_loss" in message and "rank 1: loss;" not in message
        assert "validation data" in message


@pytest.mark.parametrize("backend", BACKENDS)
def test_warmup_ramps_lr_from_lr_over_size(jobs, backend):
    results = section(jobs(backend), "warmup")
    n, warm, base = 2, 2, 0.1 * 2
    for seen, logged in results:
        want = []
        for epoch in range(3):
            for batch in range(STEPS):
                e = epoch + (batch + 1) / STEPS        # counted at the batch's end
                want.append(base / n * (e * (n - 1) / warm + 1) if epoch < warm else want[-1])
        assert seen == pytest.approx(want, rel=1e-6)
        assert seen[0] == pytest.approx(base / n * (1 + (n - 1) / (warm * STEPS)), rel=1e-6)
        assert logged[-1] == pytest.approx(base, rel=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoint_on_rank0_and_load_model_rewraps(jobs, backend):
    results = section(jobs(backend), "checkpoint_and_load")
    assert [res["written"] for res in results] == [True, False]
    for kind in ("wrapped", "plain"):
        names = {(res[kind][0], res[kind][2]) for res in results}
        assert names == {("DistributedOptimizer", "Adam")}
        assert results[0][kind][5] == results[1][kind][5], f"{kind}: ranks diverged"
        assert all(res[kind][4] > 0 for res in results), f"{kind}: training did not move"
    assert [res["wrapped"][1] for res in results] == [2, 2]    # the option was saved
    # wrapped: 2 epochs of STEPS steps, applied every 2nd; then 1 more epoch
    assert [res["wrapped"][3] for res in results] == [(2 * STEPS + STEPS) // 2] * 2
    assert [res["plain"][3] for res in results] == [2 * STEPS] * 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_value_collectives(jobs, backend):
    results = section(jobs(backend), "scalar_ops")
    for r, (mean, total, gathered, root, block) in enumerate(results):
        assert mean == [0.5, 1.0]
        assert total == [1.0]
        assert gathered == [[0, 0], [1, 1], [1, 1]]
        assert root == [6.0]
        full = np.arange(4.0) * 1 + np.arange(4.0) * 2
        assert block == full[2 * r:2 * r + 2].tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_partial_optimizer_keeps_local_layers_local(jobs, backend):
    """Local layer (weights 0, 1): the rank's own step divided by size; the rest: the mean of
    the ranks' own steps (one step from the same start, so the averaged gradient's step)."""
    results = section(jobs(backend), "partial")
    n = len(results)
    w0 = [np.array(w) for w in results[0][0]]
    plains = [[np.array(w) for w in plain] for _, plain, _ in results]
    for r, (_, _, partial) in enumerate(results):
        for i, got in enumerate(partial):
            if i < 2:
                want = w0[i] + (plains[r][i] - w0[i]) / n
            else:
                want = np.mean([p[i] for p in plains], axis=0)
            np.testing.assert_allclose(got, want, atol=1e-6, err_msg=f"rank {r} weight {i}")
    assert not np.allclose(results[0][2][0], results[1][2][0])   # local: apart


def test_unserved_backend_fails_clearly_at_import():
    env = dict(os.environ, **without(TF_EXTRAS, {"KERAS_BACKEND": "numpy",
                                                 "TF_CPP_MIN_LOG_LEVEL": "3"}))
    out = subprocess.run([sys.executable, "-c", "import hora.keras"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "ImportError" in out.stderr and "'numpy'" in out.stderr
    assert "Set KERAS_BACKEND to tensorflow, torch or jax" in out.stderr


def test_tensorflow_keras_refuses_the_torch_backend(jobs):
    pytest.importorskip("tensorflow")
    for kind, message in section(jobs("torch"), "tensorflow_keras_refused"):
        assert kind == "ImportError" and "Import hora.keras instead" in message


@pytest.mark.parametrize("backend", BACKENDS)
def test_keras_state_sync_gives_every_rank_rank0s_committed_model(jobs, backend):
    keras_elastic_job.check_model_state(section(jobs(backend), "keras_state"))


def test_tf_keras_state_sync_gives_every_rank_rank0s_committed_model(jobs):
    keras_elastic_job.check_model_state(section(jobs("tensorflow"), "tf_keras_state"))


def test_tf_state_sync_gives_every_rank_rank0s_committed_variables(jobs):
    keras_elastic_job.check_tf_state(section(jobs("tensorflow"), "tf_state"))


# the digits runs hide what Keras would import of the other backends (scikit-learn stays: the
# script loads its data with it); JAX's runs without TensorFlow, in the test below
DIGITS_HIDDEN = {"tensorflow": ("jax", "jaxlib", "pandas", "matplotlib"),
                 "torch": ("tensorflow", "tensorboard", "jax", "jaxlib", "pandas", "matplotlib"),
                 "jax": ("tensorflow", "tensorboard", "pandas", "matplotlib")}


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_keras_digits_example_trains_and_writes_on_rank0_only(tmp_path, backend):
    """The classic script at N=2: it learns, and only rank 0 writes checkpoints and
    TensorBoard event files.  JAX's run is the test below."""
    pytest.importorskip("sklearn")
    pytest.importorskip(backend)
    if backend == "tensorflow":
        pytest.importorskip("tensorboard")
    logdir = tmp_path / "runs"
    args = ["--logdir", str(logdir)] if backend == "tensorflow" else []
    env = dict(os.environ, **without(DIGITS_HIDDEN[backend], {"KERAS_BACKEND": backend,
                                                             "TF_CPP_MIN_LOG_LEVEL": "3"}))
    accuracy, _ = run_digits_example("keras_digits.py", tmp_path, 4, env, args)
    assert accuracy > 0.9
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        f"digits-{e:02d}.weights.h5" for e in range(1, 5)]
    if backend == "tensorflow":
        events = list(logdir.rglob("events.out.tfevents.*"))
        pids = {p.name.split(".")[-3] for p in events}       # ...<host>.<pid>.<n>.v2
        assert events and len(pids) == 1, f"event files from several processes: {events}"


def test_keras_digits_example_runs_on_jax_without_tensorflow(tmp_path):
    """The classic script at N=2 on Keras' JAX backend, as ``pip install "hora[jax]" keras``
    has it (no TensorFlow): it learns, and only rank 0 writes checkpoints.  XLA compiles
    without its backend optimizations, as in the jobs (COMPUTE): 5 s of CPU less, the same
    accuracy."""
    pytest.importorskip("sklearn")
    pytest.importorskip("jax")
    env = dict(os.environ, **without(DIGITS_HIDDEN["jax"], {"KERAS_BACKEND": "jax",
                                                           **COMPUTE["jax"]}))
    accuracy, _ = run_digits_example("keras_digits.py", tmp_path, 4, env)
    assert accuracy > 0.9
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        f"digits-{e:02d}.weights.h5" for e in range(1, 5)]
