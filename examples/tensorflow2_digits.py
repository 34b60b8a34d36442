"""Data-parallel training of a small CNN on scikit-learn's digits, in TensorFlow 2, with hora.

    hora run -np 2 python examples/tensorflow2_digits.py
    hora run -np 2 python examples/tensorflow2_digits.py --epochs 20 --checkpoint ckpt/digits.npz

Horovod's TensorFlow 2 recipe on a Keras model trained by a custom loop, each change marked
"hora:" below: init, pin a GPU by local rank, scale the learning rate by the number of ranks,
wrap the tape in ``hvd.DistributedGradientTape``, broadcast rank 0's model and optimizer
variables after the first step, shard the data by rank, average the metrics, and print /
checkpoint on rank 0 only.  ``import hora.tensorflow as hvd`` is the only line that differs
from the same script on Horovod.

With ``--checkpoint PATH``, rank 0 saves the model's and the optimizer's variables and the
number of finished epochs after every epoch; started again with the same path, the job
resumes after the last saved epoch (rank 0 loads and broadcasts its state to every rank).

Every rank takes its ``1/size`` share of each global batch, so averaging gradients gives the
global batch's gradient: ``-np 2 --batch-size 32 --lr 0.05`` follows
``-np 1 --batch-size 64 --lr 0.1`` up to floating-point rounding.
"""
import argparse
import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np                                             # noqa: E402
import tensorflow as tf                                        # noqa: E402
from sklearn.datasets import load_digits                       # noqa: E402

import hora.tensorflow as hvd                                  # noqa: E402

TEST_SIZE = 297                 # a fixed held-out split of the 1797 digits
MEAN, STD = 0.305, 0.376        # of the pixels scaled to [0, 1]


def make_model():
    """Two 3x3 convolutions, a 2x2 max-pool and two dense layers: 8x8x1 -> 10 logits."""
    return tf.keras.Sequential([
        tf.keras.Input((8, 8, 1)),
        tf.keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        tf.keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        tf.keras.layers.MaxPooling2D(2),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10),
    ])


def datasets():
    """((x, y) train, (x, y) test) as NumPy arrays, split the same way on every rank."""
    digits = load_digits()
    x = ((digits.images / 16.0 - MEAN) / STD).astype(np.float32)[..., None]
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(1234).permutation(len(y))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    return (x[train], y[train]), (x[test], y[test])


def shard_batches(n, batch_size, epoch, seed):
    """This rank's share of each global batch: one shuffle per epoch, the same on every rank
    (as torch's DistributedSampler), then every size-th index from this rank's."""
    order = np.random.default_rng(seed + epoch).permutation(n)
    mine = order[hvd.rank()::hvd.size()]                       # hora: shard by rank
    return [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="learning rate for one rank; scaled by the number of ranks")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--checkpoint", metavar="PATH",
                        help="save after every epoch (.npz); resume from here if it exists")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    hvd.init()                                                 # hora: join the job
    rank, size = hvd.rank(), hvd.size()
    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:                                                   # hora: one GPU per local rank
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")
    else:
        tf.config.threading.set_intra_op_parallelism_threads(1)  # hora: one core per rank

    tf.keras.utils.set_random_seed(args.seed)
    (x_train, y_train), (x_test, y_test) = datasets()
    model = make_model()
    lr = args.lr * size                                        # hora: scale the LR
    optimizer = tf.keras.optimizers.SGD(learning_rate=lr, momentum=args.momentum)
    optimizer.build(model.trainable_variables)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    start_epoch = 0
    if rank == 0 and args.checkpoint and os.path.exists(args.checkpoint):  # hora: rank 0
        saved = np.load(args.checkpoint)                                   # loads...
        for i, v in enumerate(model.variables + optimizer.variables):
            v.assign(saved[f"v{i}"])
        start_epoch = int(saved["epoch"])
        print(f"resuming from {args.checkpoint} after epoch {start_epoch}", flush=True)
    start_epoch = hvd.broadcast_object(start_epoch, root_rank=0,   # hora: ...and every
                                       name="start_epoch")         # rank starts there,
    if start_epoch:                                                # from its state
        hvd.broadcast_variables(model.variables + optimizer.variables, root_rank=0)

    @tf.function(reduce_retracing=True)      # the last batch of an epoch is smaller
    def train_step(x, y, first_batch):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
        tape = hvd.DistributedGradientTape(tape)               # hora: average gradients
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        # hora: rank 0's variables everywhere.  Horovod's recipe does it after the first
        # step, when a lazily built optimizer's variables exist; every rank here starts from
        # the same seed, so that step is the same everywhere anyway.
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables, root_rank=0)
        correct = tf.reduce_sum(tf.cast(tf.argmax(logits, 1) == y, tf.float32))
        return loss, correct

    test_acc = None
    first = True
    for epoch in range(start_epoch, args.epochs):
        optimizer.learning_rate.assign(                        # cosine decay, a function
            lr * 0.5 * (1 + math.cos(math.pi * epoch / args.epochs)))  # of the epoch
        loss_sum, correct, count = 0.0, 0.0, 0
        for idx in shard_batches(len(y_train), args.batch_size, epoch, args.seed):
            loss, right = train_step(x_train[idx], y_train[idx], first)
            first = False
            loss_sum += float(loss) * len(idx)
            correct += float(right)
            count += len(idx)
        loss, acc = hvd.allreduce(tf.constant([loss_sum / count, correct / count]),  # hora:
                                  name="train_metrics").numpy()  # average over ranks
        test_loss, test_acc = evaluate(model, loss_fn, x_test, y_test)
        if rank == 0:                                          # hora: rank 0 reports
            print(f"epoch {epoch + 1:2d}  train loss {loss:.4f}  acc {acc:.3f}  "
                  f"test loss {test_loss:.4f}  acc {test_acc:.3f}  "
                  f"({size} rank{'s' if size > 1 else ''})", flush=True)
            if args.checkpoint:                                # hora: and checkpoints
                save_checkpoint(args.checkpoint, epoch + 1, model, optimizer)
    if rank == 0:
        if test_acc is None:
            print(f"nothing to do: the checkpoint has {start_epoch} epochs, "
                  f"--epochs is {args.epochs}")
        else:
            saved = f", saved {args.checkpoint}" if args.checkpoint else ""
            print(f"final test accuracy {test_acc:.3f}{saved}", flush=True)
    hvd.shutdown()


def evaluate(model, loss_fn, x, y):
    """Loss and accuracy on the whole test set: each rank scores its slice, the sums are added
    over the ranks (exact, unlike averaging per-rank means of unequal slices)."""
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    logits = model(x, training=False)
    sums = tf.constant([float(loss_fn(y, logits)) * len(y),
                        float(tf.reduce_sum(tf.cast(tf.argmax(logits, 1) == y, tf.float32))),
                        len(y)], dtype=tf.float64)
    sums = hvd.allreduce(sums, op=hvd.Sum, name="test_metrics").numpy()  # hora: add over ranks
    return sums[0] / sums[2], sums[1] / sums[2]


def save_checkpoint(path, epoch, model, optimizer):
    """Write atomically, so a job killed mid-save leaves the previous checkpoint intact."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.npz"
    np.savez(tmp, epoch=epoch, **{f"v{i}": v.numpy() for i, v in
                                  enumerate(model.variables + optimizer.variables)})
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
