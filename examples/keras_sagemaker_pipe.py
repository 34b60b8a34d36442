"""Keras on SageMaker Pipe mode with hora: every rank streams its own channel.

    hora run -np 2 python examples/keras_sagemaker_pipe.py --epochs 2

In Pipe mode SageMaker streams a channel into a FIFO, a new one for each pass over the data:
``/opt/ml/input/data/<channel>_<epoch>``.  A FIFO has one reader, so a job with several
ranks per host gives each rank its own channels, ``train_0`` .. ``train_{N-1}`` and
``validation_0`` ..; ``hora.data.sagemaker_channel("train", epoch=e)`` is this rank's FIFO
for pass ``e``.  (Outside a SageMaker container, HORA_SAGEMAKER_ROOT names another tree.)

Horovod's Keras recipe, each change marked "hora:": init, scale the learning rate by the
number of ranks, wrap the optimizer in ``hvd.DistributedOptimizer``, broadcast rank 0's
variables after the first batch, average the metrics, save the model on rank 0 only.  Every
rank validates on its own ``validation_<rank>`` channel inside ``fit()``: a rank that skips
validation would go on into the next epoch's allreduces while the others validate, and wait
for them (the stall inspector says so, naming the ranks).

The records are TFRecords of ``tf.train.Example``: ``x`` (FEATURES floats) and ``y`` (a class
in ``range(CLASSES)``).  Every rank's channels must hold the same number of batches per pass,
so that every rank runs the same number of steps.
``tf.data.TFRecordDataset`` cannot read a FIFO (it reads at offsets: "Illegal seek"), so
``hora.data.read_tfrecords`` reads the stream in Python and ``tf.data`` takes it from there.
"""
import argparse
import json
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras                                                   # noqa: E402
import tensorflow as tf                                        # noqa: E402

import hora.data                                               # noqa: E402
import hora.tensorflow.keras as hvd                            # noqa: E402
from hora.integrations.sagemaker import save_model             # noqa: E402

FEATURES = 4
CLASSES = 3


def read_tfrecords(path):
    """The records of this rank's FIFO at ``path``, in order (hora.data reads the stream)."""
    count = 0
    for record in hora.data.read_tfrecords(path):              # hora: a FIFO, front to back
        count += 1
        yield record
    print(f"rank {hvd.rank()}: read {count} records from {os.fsdecode(path)}", flush=True)


def parse(records):
    spec = {"x": tf.io.FixedLenFeature([FEATURES], tf.float32),
            "y": tf.io.FixedLenFeature([], tf.int64)}
    example = tf.io.parse_example(records, spec)
    return example["x"], example["y"]


class PipeChannel:
    """This rank's Pipe-mode channel ``name`` as a ``tf.data`` dataset whose every pass
    streams the FIFO of the current epoch, ``<channel>_<epoch>``.

    Keras starts a new pass over the dataset for each epoch's training (when ``fit()`` is
    given no ``steps_per_epoch``) and for each validation, and a pass opens its FIFO when
    its first record is asked for; :class:`FollowEpochs` points it at the epoch that begins.
    """

    def __init__(self, name, batch_size):
        self.name = name
        self.follow(0)
        self.dataset = (tf.data.Dataset.from_generator(
                            self._records, output_signature=tf.TensorSpec((), tf.string))
                        .batch(batch_size, drop_remainder=True)
                        .map(parse))

    def follow(self, epoch):
        """Point the next pass at ``epoch``'s FIFO.  Found here, in Python, not in the
        dataset's generator: an error (not in SageMaker, no such channel) then reaches the
        caller as it is, not wrapped in a TensorFlow op's traceback."""
        # hora: this rank's own FIFO: <name>_<rank>_<epoch>
        self.path = hora.data.sagemaker_channel(self.name, epoch=epoch)

    def _records(self):
        return read_tfrecords(self.path)


class FollowEpochs(keras.callbacks.Callback):
    """Point each :class:`PipeChannel` at the FIFOs of the epoch that begins."""

    def __init__(self, *channels):
        super().__init__()
        self.channels = channels

    def on_epoch_begin(self, epoch, logs=None):
        for channel in self.channels:
            channel.follow(epoch)


def make_model():
    return keras.Sequential([keras.Input((FEATURES,)),
                             keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(CLASSES)])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=2, help="passes: FIFOs per channel")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate of one rank")
    args = parser.parse_args()

    hvd.init()                                                              # hora
    keras.utils.set_random_seed(42)
    model = make_model()
    opt = keras.optimizers.SGD(learning_rate=args.lr * hvd.size())         # hora: scale lr
    model.compile(optimizer=hvd.DistributedOptimizer(opt),                 # hora
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)
    train = PipeChannel("train", args.batch_size)
    validation = PipeChannel("validation", args.batch_size)
    callbacks = [FollowEpochs(train, validation),
                 hvd.callbacks.BroadcastGlobalVariablesCallback(0),        # hora
                 hvd.callbacks.MetricAverageCallback()]                    # hora
    # a pass ends where its FIFO's stream ends, which Keras warns about in the first epoch
    warnings.filterwarnings("ignore", message="Your input ran out of data")
    history = model.fit(train.dataset, validation_data=validation.dataset, epochs=args.epochs,
                        shuffle=False, callbacks=callbacks,
                        verbose=2 if hvd.rank() == 0 else 0)
    # every rank's averaged metrics, the same on every rank
    print(f"rank {hvd.rank()}: history {json.dumps(history.history)}", flush=True)
    save_model(lambda path: model.save(path), "model.keras")               # hora: rank 0
    hvd.shutdown()


if __name__ == "__main__":
    main()
