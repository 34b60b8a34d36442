"""Keras in SageMaker Pipe mode (examples/keras_sagemaker_pipe.py) on 2 ranks, and the stall
of a job where only rank 0 validates inside fit().

The fake SageMaker tree (tests/sagemaker_tree.py) gives each rank its own Pipe-mode channels,
``train_<rank>`` and ``validation_<rank>``: real FIFOs, one per epoch, that a writer process
fills with TFRecords as SageMaker would.  A FIFO's records reach only the process that opens
it, so "rank r read every record of train_r_e" is: rank r says it read that FIFO to its end,
and the writer says it wrote the FIFO's every record (none went unread, none were refused).
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from tests.helpers import TF_EXTRAS, without  # noqa: E402
from tests.sagemaker_tree import PipeWriter, make_tree, tfrecord  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "keras_sagemaker_pipe.py"
N = 2
EPOCHS = 2
BATCH = 8
RECORDS = {"train": 32, "validation": 8}        # per rank and pass: whole batches
_LINE = re.compile(r"^\[(\d+)\]<(stdout|stderr)>:(.*)$")


def _example(x, y):
    return tf.train.Example(features=tf.train.Features(feature={
        "x": tf.train.Feature(float_list=tf.train.FloatList(value=x)),
        "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[y]))})).SerializeToString()


def _records(rank, epoch, n):
    rng = np.random.default_rng([rank, epoch, n])
    xs = rng.standard_normal((n, 4)).astype(np.float32)
    return [_example(x.tolist(), int(np.argmax(x[:3]))) for x in xs]


def _env(root, **extra):
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("HORA_", "HOROVOD_", "OMPI_", "PMI_", "SLURM_", "SM_"))
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return dict(base, **without(TF_EXTRAS, {
        "HORA_SAGEMAKER_ROOT": str(root), "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONPATH": os.pathsep.join([str(REPO)] + [p for p in sys.path if p])}), **extra)


def _hora_run(argv, env, timeout_s, np_=N):
    """(exit code, output) of ``hora run -np np_ argv``; past ``timeout_s`` it is stopped (its
    ranks with it) and the test fails with what it said."""
    proc = subprocess.Popen([sys.executable, "-m", "hora", "run", "-np", str(np_), *argv],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()                    # hora run stops every rank on SIGTERM
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"hora run did not finish in {timeout_s} s:\n{out}")
    return proc.returncode, out


def _by_rank(output, stream):
    """``{rank: text}``: what each rank wrote on ``stream``, without hora run's prefixes."""
    out = {}
    for line in output.splitlines():
        m = _LINE.match(line)
        if m and m.group(2) == stream:
            out.setdefault(int(m.group(1)), []).append(m.group(3))
    return {r: "\n".join(lines) for r, lines in out.items()}


def test_tfrecord_framing_is_what_tensorflow_reads(tmp_path):
    records = _records(0, 0, 5) + [b"", b"x" * 70000]
    path = tmp_path / "r.tfrecord"
    path.write_bytes(b"".join(map(tfrecord, records)))
    # TFRecordDataset checks both CRCs of every record
    assert [r.numpy() for r in tf.data.TFRecordDataset(str(path))] == records


@pytest.mark.timeout(120)
def test_keras_pipe_mode_each_rank_streams_and_validates_on_its_own_channels(tmp_path):
    root = make_tree(tmp_path / "opt_ml", ["algo-1"], "algo-1",
                     channels={f"{c}_{r}": "Pipe" for c in RECORDS for r in range(N)},
                     pipe_epochs=EPOCHS)
    writer = PipeWriter(root, {f"{c}_{r}": [_records(r + 10 * (c == "validation"), e, n)
                                            for e in range(EPOCHS)]
                               for c, n in RECORDS.items() for r in range(N)})
    try:
        code, out = _hora_run([sys.executable, str(EXAMPLE), "--epochs", str(EPOCHS),
                               "--batch-size", str(BATCH)], _env(root), timeout_s=90)
        assert code == 0, out
        fed = writer.wait(timeout_s=10)
    finally:
        writer.kill()
    # the writer wrote every record of every FIFO, each FIFO once
    assert fed == {f"{c}_{r}_{e}": n for c, n in RECORDS.items() for r in range(N)
                   for e in range(EPOCHS)}, out
    said = _by_rank(out, "stdout")
    data = root / "input" / "data"
    for r in range(N):
        # each rank read its own FIFOs, every record of each, and no one else's
        reads = re.findall(rf"^rank {r}: read (\d+) records from (.*)$", said[r], re.M)
        assert sorted(reads) == sorted((str(n), str(data / f"{c}_{r}_{e}"))
                                       for c, n in RECORDS.items() for e in range(EPOCHS)), out
        # training completed, and every rank validated in every epoch (metrics averaged)
        history = json.loads(re.search(rf"^rank {r}: history (.*)$", said[r], re.M).group(1))
        assert len(history["loss"]) == EPOCHS and len(history["val_loss"]) == EPOCHS, history
        assert all(np.isfinite(history["loss"] + history["val_loss"]))
    assert said[0].count("Epoch ") == EPOCHS and "val_accuracy" in said[0]
    assert (root / "model" / "model.keras").is_file()          # saved by rank 0


# -- only rank 0 validates: a stall the inspector explains -----------------------------------
ONLY_RANK_0_VALIDATES = """
import time
import warnings

import keras
import numpy as np

import hora.tensorflow.keras as hvd


class SlowValidation(keras.callbacks.Callback):
    # the first epoch's validation (4 batches) takes 3.2 s: rank 1, which has none, waits
    # meanwhile in the second epoch's first allreduce.  The second epoch's runs at full
    # speed (rank 1 has left fit() by then: no allreduce of its waits for it)
    slowed = 0

    def on_test_batch_begin(self, batch, logs=None):
        if self.slowed < 4:
            self.slowed += 1
            time.sleep(0.8)


hvd.init()
rng = np.random.default_rng(hvd.rank())
x = rng.standard_normal((32, 4)).astype("float32")
y = (x[:, 0] > 0).astype("int64")
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size())),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              jit_compile=False)
# the mistake: only rank 0 is given validation data.  (No MetricAverageCallback: it would
# average val_loss, which only rank 0 has.)
val = (x[:16], y[:16]) if hvd.rank() == 0 else None
warnings.filterwarnings("ignore")
model.fit(x, y, batch_size=8, epochs=2, validation_data=val, validation_batch_size=4,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), SlowValidation()],
          verbose=0)     # the broadcast callback tells the stall inspector about validation
print("rank", hvd.rank(), "done", flush=True)
hvd.shutdown()
"""


@pytest.mark.timeout(120)
def test_outside_sagemaker_the_example_fails_with_horas_own_error(tmp_path):
    # an empty tree: no SageMaker configuration.  The channel is found in Python, so the
    # error reaches the user as hora raised it, not inside a TensorFlow op's traceback.  Every
    # rank raises it alike, on its own: one rank shows it (a second would only be stopped by
    # the launcher, which test_launcher_stops.py checks)
    (tmp_path / "opt_ml").mkdir()
    code, out = _hora_run([sys.executable, str(EXAMPLE), "--epochs", "1"],
                          _env(tmp_path / "opt_ml"), 90, np_=1)
    assert code != 0, out
    errors = _by_rank(out, "stderr")
    lasts = [[line for line in err.splitlines() if line.strip()][-1:] for err in
             errors.values()]
    assert ["hora.errors.SageMakerConfigError: not in a SageMaker training container: "
            f"{tmp_path / 'opt_ml' / 'input' / 'config' / 'resourceconfig.json'} does not "
            "exist (set HORA_SAGEMAKER_ROOT or root= for another tree)"] in lasts, out
    assert "PyFunc" not in out and "Graph execution error" not in out, out


@pytest.mark.timeout(120)
def test_only_rank_0_validating_inside_fit_is_a_stall_the_warning_explains(tmp_path):
    script = tmp_path / "only_rank_0_validates.py"
    script.write_text(ONLY_RANK_0_VALIDATES)
    code, out = _hora_run([sys.executable, str(script)],
                          _env(tmp_path, HORA_STALL_CHECK_TIME_SECONDS="1"), timeout_s=90)
    # rank 0's first validation (4 batches, 3.2 s) ends, and the job with it
    assert code == 0, out
    said = _by_rank(out, "stdout")
    assert all(f"rank {r} done" in said[r] for r in range(N)), out
    err = _by_rank(out, "stderr")[0]
    assert "waiting for remainder of ranks" in err and "Missing ranks:\n0: [" in err, out
    # what happened: rank 0 validates while rank 1 waits in its gradients' allreduce
    hint = re.search(r"^Hint: rank 0 is running validation inside fit\(\) while rank 1 waits "
                     r"for it in \[(.+?)\]: (.*)$", err, re.M)
    assert hint, err
    missing = re.search(r"^0: \[(.+?)\]$", err, re.M).group(1)
    assert hint.group(1) == missing
    # and what to do
    advice = hint.group(2)
    assert "Give every rank validation data (its own shard or channel" in advice
    assert "or give it to none" in advice and "validate after fit() returns" in advice
    # rank 0's own stack, labelled with what it is doing
    assert "rank 0, running validation inside fit():" in err, err
