"""Data-parallel training of a small CNN on scikit-learn's digits, in MXNet Gluon, with hora.

    hora run -np 2 python examples/mxnet_digits.py
    hora run -np 2 python examples/mxnet_digits.py --epochs 20 --checkpoint ckpt/digits.params

MXNet 1.9.1 needs ``numpy<1.24``: run this from a venv of its own
(``python3 -m venv mx && mx/bin/pip install -e ".[mxnet]" scikit-learn``, then
``mx/bin/hora run ...`` or ``mx/bin/python -m hora run ...``).

A single-process Gluon script plus the usual Horovod changes, each marked "hora:" below:
init, scale the learning rate by the number of ranks, train with ``hvd.DistributedTrainer``,
broadcast rank 0's initial parameters (they are initialised on the first forward pass, and
broadcast then), shard the data by rank, add the metrics over the ranks, and print /
checkpoint on rank 0 only.  ``import hora.mxnet as hvd`` is the only line that differs
from the same script on Horovod.

Every rank takes its ``1/size`` share of each global batch and ``trainer.step`` is given
the per-rank batch size, so the update is the global batch's: ``-np 2 --batch-size 32
--lr 0.05`` follows ``-np 1 --batch-size 64 --lr 0.1`` up to floating-point rounding.  The
data, the split and the model are those of ``pytorch_digits.py``.
"""
import argparse
import math
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")                  # hora: one core per rank

import mxnet as mx                                             # noqa: E402
import numpy as np                                             # noqa: E402
from mxnet import autograd, gluon                              # noqa: E402
from mxnet.gluon import nn                                     # noqa: E402
from sklearn.datasets import load_digits                       # noqa: E402

import hora.mxnet as hvd                                       # noqa: E402

TEST_SIZE = 297                 # a fixed held-out split of the 1797 digits
MEAN, STD = 0.305, 0.376        # of the pixels scaled to [0, 1]


def make_net():
    """Two 3x3 convolutions (16, 32 channels), a 2x2 max-pool, dense 512 -> 64 -> 10.  The
    input sizes are left to Gluon's deferred initialisation."""
    net = nn.HybridSequential(prefix="digits_")
    with net.name_scope():
        net.add(nn.Conv2D(16, 3, padding=1, activation="relu"),
                nn.Conv2D(32, 3, padding=1, activation="relu"),
                nn.MaxPool2D(2), nn.Flatten(),
                nn.Dense(64, activation="relu"), nn.Dense(10))
    return net


def datasets():
    """((x, y) train, (x, y) test) as NumPy arrays (NCHW), split the same way on every rank."""
    digits = load_digits()
    x = ((digits.images / 16.0 - MEAN) / STD).astype(np.float32)[:, None]
    y = digits.target.astype(np.float32)
    order = np.random.default_rng(1234).permutation(len(y))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    return (x[train], y[train]), (x[test], y[test])


def shard_batches(n, batch_size, epoch, seed):
    """This rank's share of each global batch: one shuffle per epoch, the same on every rank,
    then every size-th index from this rank's."""
    order = np.random.default_rng(seed + epoch).permutation(n)
    mine = order[hvd.rank()::hvd.size()]                       # hora: shard by rank
    return [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]


def train_epoch(net, trainer, loss_fn, x, y, batches):
    """One pass over this rank's shard; returns this rank's (loss sum, correct, count)."""
    loss_sum, correct, count = 0.0, 0, 0
    for idx in batches:
        data, label = mx.nd.array(x[idx]), mx.nd.array(y[idx])
        with autograd.record():
            output = net(data)
            loss = loss_fn(output, label)
        loss.backward()
        trainer.step(len(idx))          # DistributedTrainer: the gradients summed over ranks,
        loss_sum += float(loss.sum().asscalar())    # divided by size * batch
        correct += int((output.argmax(axis=1) == label).sum().asscalar())
        count += len(idx)
    return loss_sum, correct, count


def evaluate(net, loss_fn, x, y):
    """Loss and accuracy on the whole test set: each rank scores its slice, the sums are
    added over the ranks (exact, unlike averaging per-rank means of unequal slices)."""
    data = mx.nd.array(x[hvd.rank()::hvd.size()])
    label = mx.nd.array(y[hvd.rank()::hvd.size()])
    output = net(data)
    sums = mx.nd.array([loss_fn(output, label).sum().asscalar(),
                        (output.argmax(axis=1) == label).sum().asscalar(), len(label)],
                       dtype="float64")
    sums = hvd.allreduce(sums, op=hvd.Sum, name="test_metrics").asnumpy()  # hora: add over
    return sums[0] / sums[2], sums[1] / sums[2]                             # ranks


def save_checkpoint(path, net, trainer):
    """Write atomically, so a job killed mid-save leaves the previous checkpoint intact."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    net.save_parameters(f"{path}.tmp")
    trainer.save_states(f"{path}.states.tmp")
    os.replace(f"{path}.tmp", path)
    os.replace(f"{path}.states.tmp", f"{path}.states")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="learning rate for one rank; scaled by the number of ranks")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--checkpoint", metavar="PATH",
                        help="rank 0 saves the parameters here (and the trainer's state in "
                             "PATH.states) after every epoch")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    hvd.init()                                                 # hora: join the job
    rank, size = hvd.rank(), hvd.size()
    mx.random.seed(args.seed)
    (x_train, y_train), (x_test, y_test) = datasets()

    net = make_net()
    net.initialize(mx.init.Xavier(magnitude=2.0), ctx=mx.cpu())
    net.hybridize()
    params = net.collect_params()
    hvd.broadcast_parameters(params, root_rank=0)              # hora: rank 0's weights (on
    lr = args.lr * size                                        # the first forward pass)
    trainer = hvd.DistributedTrainer(                          # hora: scale the LR, and
        params, "sgd", {"learning_rate": lr,                   # sum the gradients over
                        "momentum": args.momentum})            # ranks
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    test_acc = None
    for epoch in range(args.epochs):
        trainer.set_learning_rate(lr * 0.5 * (1 + math.cos(math.pi * epoch / args.epochs)))
        sums = train_epoch(net, trainer, loss_fn, x_train, y_train,
                           shard_batches(len(y_train), args.batch_size, epoch, args.seed))
        sums = hvd.allreduce(mx.nd.array(sums, dtype="float64"),   # hora: add the metrics
                             op=hvd.Sum, name="train_metrics").asnumpy()   # over ranks
        loss, acc = sums[0] / sums[2], sums[1] / sums[2]
        test_loss, test_acc = evaluate(net, loss_fn, x_test, y_test)
        if rank == 0:                                          # hora: rank 0 reports
            print(f"epoch {epoch + 1:2d}  train loss {loss:.4f}  acc {acc:.3f}  "
                  f"test loss {test_loss:.4f}  acc {test_acc:.3f}  "
                  f"({size} rank{'s' if size > 1 else ''})", flush=True)
            if args.checkpoint:                                # hora: and checkpoints
                save_checkpoint(args.checkpoint, net, trainer)
    if rank == 0 and test_acc is not None:
        saved = f", saved {args.checkpoint}" if args.checkpoint else ""
        print(f"final test accuracy {test_acc:.3f}{saved}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
