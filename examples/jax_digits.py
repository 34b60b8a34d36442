"""Data-parallel training of a small CNN on scikit-learn's digits, in plain JAX + optax, with hora.

    hora run -np 2 python examples/jax_digits.py
    hora run -np 2 python examples/jax_digits.py --epochs 20

Horovod's recipe, each change marked "hora:" below: init, scale the learning rate by the
number of ranks, wrap the optax transformation in ``hvd.DistributedOptimizer`` (it averages
the gradients over the ranks inside the jitted step), start every rank from rank 0's
parameters, shard the data by rank, add the metrics over the ranks, and print on rank 0 only.

Every rank takes its ``1/size`` share of each global batch, so averaging gradients gives the
global batch's gradient: ``-np 2 --batch-size 32 --lr 0.05`` follows
``-np 1 --batch-size 64 --lr 0.1`` up to floating-point rounding.  The data, the split and the
model are those of ``tensorflow2_digits.py``.
"""
import argparse
import math
import os

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false "
                                   "intra_op_parallelism_threads=1")   # hora: one core per rank

import jax                                                     # noqa: E402
import jax.numpy as jnp                                        # noqa: E402
import numpy as np                                             # noqa: E402
import optax                                                   # noqa: E402
from sklearn.datasets import load_digits                       # noqa: E402

import hora.jax as hvd                                         # noqa: E402

TEST_SIZE = 297                 # a fixed held-out split of the 1797 digits
MEAN, STD = 0.305, 0.376        # of the pixels scaled to [0, 1]


def init_params(key):
    """Two 3x3 convolutions (16, 32 channels), a 2x2 max-pool, dense 512 -> 64 -> 10, He
    initialised."""
    ks = jax.random.split(key, 4)

    def he(k, shape, fan_in):
        return jax.random.normal(k, shape) * math.sqrt(2.0 / fan_in)
    return {"c1": he(ks[0], (3, 3, 1, 16), 9), "b1": jnp.zeros(16),
            "c2": he(ks[1], (3, 3, 16, 32), 144), "b2": jnp.zeros(32),
            "d1": he(ks[2], (512, 64), 512), "b3": jnp.zeros(64),
            "d2": he(ks[3], (64, 10), 64), "b4": jnp.zeros(10)}


def forward(p, x):
    """8x8x1 images (NHWC) -> 10 logits."""
    dims = ("NHWC", "HWIO", "NHWC")
    h = jax.lax.conv_general_dilated(x, p["c1"], (1, 1), "SAME", dimension_numbers=dims)
    h = jax.nn.relu(h + p["b1"])
    h = jax.lax.conv_general_dilated(h, p["c2"], (1, 1), "SAME", dimension_numbers=dims)
    h = jax.nn.relu(h + p["b2"])
    h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    h = jax.nn.relu(h.reshape(h.shape[0], -1) @ p["d1"] + p["b3"])
    return h @ p["d2"] + p["b4"]


def loss_fn(p, x, y):
    logits = forward(p, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits


def datasets():
    """((x, y) train, (x, y) test) as NumPy arrays, split the same way on every rank."""
    digits = load_digits()
    x = ((digits.images / 16.0 - MEAN) / STD).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(1234).permutation(len(y))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    return (x[train], y[train]), (x[test], y[test])


def shard_batches(n, batch_size, epoch, seed):
    """This rank's share of each global batch: one shuffle per epoch, the same on every rank,
    then every size-th index from this rank's."""
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
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    hvd.init()                                                 # hora: join the job
    rank, size = hvd.rank(), hvd.size()
    (x_train, y_train), (x_test, y_test) = datasets()
    steps_per_epoch = math.ceil(math.ceil(len(y_train) / size) / args.batch_size)
    lr = args.lr * size                                        # hora: scale the LR

    def schedule(count):                                       # cosine decay by epoch
        epoch = count // steps_per_epoch
        return lr * 0.5 * (1 + jnp.cos(jnp.pi * epoch / args.epochs))

    tx = hvd.DistributedOptimizer(                             # hora: average gradients
        optax.sgd(schedule, momentum=args.momentum))
    params = init_params(jax.random.PRNGKey(args.seed))
    params = hvd.broadcast_parameters(params, root_rank=0)     # hora: rank 0's parameters
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, x, y):
        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        correct = jnp.sum(jnp.argmax(logits, 1) == y)
        return optax.apply_updates(params, updates), opt_state, loss, correct

    test_acc = None
    for epoch in range(args.epochs):
        loss_sum, correct, count = 0.0, 0, 0
        for idx in shard_batches(len(y_train), args.batch_size, epoch, args.seed):
            params, opt_state, loss, right = train_step(params, opt_state, x_train[idx],
                                                        y_train[idx])
            loss_sum += float(loss) * len(idx)
            correct += int(right)
            count += len(idx)
        sums = hvd.allreduce(jnp.asarray([loss_sum, correct, count], jnp.float32),  # hora: add
                             op=hvd.Sum, name="train_metrics")                   # over ranks
        loss, acc = float(sums[0] / sums[2]), float(sums[1] / sums[2])
        test_loss, test_acc = evaluate(params, x_test, y_test)
        if rank == 0:                                          # hora: rank 0 reports
            print(f"epoch {epoch + 1:2d}  train loss {loss:.4f}  acc {acc:.3f}  "
                  f"test loss {test_loss:.4f}  acc {test_acc:.3f}  "
                  f"({size} rank{'s' if size > 1 else ''})", flush=True)
    if rank == 0 and test_acc is not None:
        print(f"final test accuracy {test_acc:.3f}", flush=True)
    hvd.shutdown()


def evaluate(params, x, y):
    """Loss and accuracy on the whole test set: each rank scores its slice, the sums are added
    over the ranks (exact, unlike averaging per-rank means of unequal slices)."""
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    loss, logits = loss_fn(params, x, y)
    sums = jnp.asarray([float(loss) * len(y), float(jnp.sum(jnp.argmax(logits, 1) == y)),
                        len(y)], jnp.float32)
    sums = hvd.allreduce(sums, op=hvd.Sum, name="test_metrics")  # hora: add over ranks
    return float(sums[0] / sums[2]), float(sums[1] / sums[2])


if __name__ == "__main__":
    main()
