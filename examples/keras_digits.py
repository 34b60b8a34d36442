"""Data-parallel training of a small CNN on scikit-learn's digits with Keras ``fit``, with hora.

    hora run -np 2 python examples/keras_digits.py
    KERAS_BACKEND=torch hora run -np 2 python examples/keras_digits.py
    KERAS_BACKEND=jax hora run -np 2 python examples/keras_digits.py
    hora run -np 2 python examples/keras_digits.py --epochs 12 --logdir runs/digits

The classic Horovod Keras script, each change marked "hora:" below: init, pin a GPU by local
rank, scale the learning rate by the number of ranks and warm it up, wrap the optimizer in
``hvd.DistributedOptimizer``, broadcast rank 0's initial weights with a callback, average
the metrics over the ranks, shard the data by rank, and write checkpoints and TensorBoard
event files on rank 0 only.  ``import hora.keras as hvd`` stands for Horovod's
``import horovod.tensorflow.keras as hvd`` (which also works here, on the TensorFlow
backend); ``hora.keras`` runs on Keras' torch and JAX backends as well.
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras                                                  # noqa: E402
import numpy as np                                            # noqa: E402
from sklearn.datasets import load_digits                      # noqa: E402

import hora.keras as hvd                                      # noqa: E402

TEST_SIZE = 297                 # a fixed held-out split of the 1797 digits
MEAN, STD = 0.305, 0.376        # of the pixels scaled to [0, 1]


def make_model():
    """Two 3x3 convolutions, a 2x2 max-pool and two dense layers: 8x8x1 -> 10 logits."""
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


def datasets():
    """((x, y) train, (x, y) test) as NumPy arrays, split the same way on every rank."""
    digits = load_digits()
    x = ((digits.images / 16.0 - MEAN) / STD).astype(np.float32)[..., None]
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(1234).permutation(len(y))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    return (x[train], y[train]), (x[test], y[test])


def pin_devices():
    """hora: one GPU per local rank, or one CPU thread per rank."""
    if keras.backend.backend() == "torch":
        import torch
        if torch.cuda.is_available():
            torch.cuda.set_device(hvd.local_rank())
        else:
            torch.set_num_threads(1)
        return
    if keras.backend.backend() == "jax":
        import jax
        # JAX takes its devices and threads when it first computes, which it has not yet
        jax.config.update("jax_cuda_visible_devices", str(hvd.local_rank()))
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_cpu_multi_thread_eigen=false").strip()
        return
    import tensorflow as tf
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
    else:
        tf.config.threading.set_intra_op_parallelism_threads(1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="learning rate for one rank; scaled by the number of ranks")
    parser.add_argument("--warmup-epochs", type=int, default=2)
    parser.add_argument("--checkpoint-dir", default="checkpoints",
                        help="rank 0 writes the best model here")
    parser.add_argument("--logdir", default=None,
                        help="TensorBoard event files (rank 0 only; needs tensorflow)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    hvd.init()                                                # hora: join the job
    pin_devices()
    keras.utils.set_random_seed(args.seed + hvd.rank())       # ranks start apart: the
    (x_train, y_train), (x_test, y_test) = datasets()         # broadcast below matters
    x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
    x_val, y_val = x_test[hvd.rank()::hvd.size()], y_test[hvd.rank()::hvd.size()]  # hora: shard

    model = make_model()
    lr = args.lr * hvd.size()                                 # hora: scale the LR
    optimizer = hvd.DistributedOptimizer(                     # hora: average gradients
        keras.optimizers.SGD(learning_rate=lr, momentum=0.9))
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  # hora: no XLA on TensorFlow; on JAX, jit (hora's collectives are
                  # host callbacks there)
                  jit_compile=keras.backend.backend() == "jax")

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),    # hora: rank 0's weights
        hvd.callbacks.MetricAverageCallback(),                # hora: metrics over ranks
        hvd.callbacks.LearningRateWarmupCallback(             # hora: warm the LR up
            initial_lr=lr, warmup_epochs=args.warmup_epochs, momentum_correction=False),
        keras.callbacks.ReduceLROnPlateau(patience=3, factor=0.5, verbose=0),
    ]
    if hvd.rank() == 0:                                       # hora: rank 0 writes files
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        callbacks.append(keras.callbacks.ModelCheckpoint(
            os.path.join(args.checkpoint_dir, "digits-{epoch:02d}.weights.h5"),
            save_weights_only=True))
        if args.logdir:
            callbacks.append(keras.callbacks.TensorBoard(args.logdir))

    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
              validation_data=(x_val, y_val), callbacks=callbacks,
              verbose=2 if hvd.rank() == 0 else 0)            # hora: rank 0 reports

    _, test_acc = model.evaluate(x_test, y_test, verbose=0)   # the same weights everywhere
    if hvd.rank() == 0:
        print(f"final test accuracy {test_acc:.3f} ({hvd.size()} rank"
              f"{'s' if hvd.size() > 1 else ''}, Keras on {keras.backend.backend()})",
              flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
