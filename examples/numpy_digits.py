"""Data-parallel training of a small MLP on scikit-learn's digits, in NumPy, with hora.

    hora run -np 2 python examples/numpy_digits.py

The usual Horovod changes, each marked "hora:" below: init, scale the learning rate by the
number of ranks, broadcast rank 0's initial weights, shard the data by rank, average the
gradients every step, average the metrics, and print / checkpoint on rank 0 only.

Rank r trains on its slice of every global batch, so averaging the ranks' gradients gives
exactly the gradient of the whole global batch: the run matches a single process that uses
``--batch-size`` × size and ``--lr`` × size (the tests check this).
"""
import argparse
import os

import numpy as np
from sklearn.datasets import load_digits

import hora


def init_params(rng, sizes):
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        params.append(rng.normal(0, np.sqrt(2.0 / fan_in), size=(fan_in, fan_out)))
        params.append(np.zeros(fan_out))
    return params


def forward_backward(params, x, y):
    """Mean cross-entropy loss, accuracy and gradients of a ReLU MLP."""
    acts = [x]
    for i in range(0, len(params) - 2, 2):
        acts.append(np.maximum(acts[-1] @ params[i] + params[i + 1], 0.0))
    logits = acts[-1] @ params[-2] + params[-1]
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    n = len(y)
    loss = -np.log(probs[np.arange(n), y] + 1e-12).mean()
    acc = (probs.argmax(axis=1) == y).mean()
    delta = probs
    delta[np.arange(n), y] -= 1.0
    delta /= n
    grads = [None] * len(params)
    for i in range(len(params) - 2, -1, -2):
        grads[i] = acts[i // 2].T @ delta
        grads[i + 1] = delta.sum(axis=0)
        if i:
            delta = (delta @ params[i].T) * (acts[i // 2] > 0)
    return loss, acc, grads


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by size")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default="checkpoints/numpy_digits.npz")
    args = parser.parse_args()

    hora.init()                                                   # hora: join the job
    rank, size = hora.rank(), hora.size()

    digits = load_digits()
    x = digits.data / 16.0
    y = digits.target
    order = np.random.default_rng(1234).permutation(len(y))
    test, train = order[:297], order[297:]

    rng = np.random.default_rng(args.seed + rank)                 # ranks start different...
    params = init_params(rng, [64, args.hidden, 10])
    params = [hora.broadcast(p, root_rank=0, name=f"init.{i}")    # hora: ...rank 0's weights
              for i, p in enumerate(params)]
    lr = args.lr * size                                           # hora: scale the LR

    global_batch = args.batch_size * size
    steps = len(train) // global_batch
    for epoch in range(args.epochs):
        perm = np.random.default_rng(args.seed * 1000 + epoch).permutation(train)
        losses, accs = [], []
        for step in range(steps):
            batch = perm[step * global_batch:(step + 1) * global_batch]
            mine = batch[rank * args.batch_size:(rank + 1) * args.batch_size]  # hora: shard
            loss, acc, grads = forward_backward(params, x[mine], y[mine])
            grads = hora.grouped_allreduce(grads, op=hora.Average,      # hora: average grads
                                           name="grads")
            for p, g in zip(params, grads):
                p -= lr * g
            losses.append(loss)
            accs.append(acc)
        metrics = hora.allreduce(np.array([np.mean(losses), np.mean(accs)]),  # hora: average
                                 name="metrics")                               # the metrics
        test_loss, test_acc, _ = forward_backward(params, x[test], y[test])
        if rank == 0:                                             # hora: report on rank 0
            print(f"epoch {epoch + 1:2d}  train loss {metrics[0]:.4f}  acc {metrics[1]:.3f}  "
                  f"test acc {test_acc:.3f}  ({size} rank{'s' if size > 1 else ''})", flush=True)
    if rank == 0:                                                 # hora: checkpoint on rank 0
        os.makedirs(os.path.dirname(args.checkpoint) or ".", exist_ok=True)
        np.savez(args.checkpoint, *params, test_acc=test_acc)
        print(f"saved {args.checkpoint} (test accuracy {test_acc:.3f})")
    hora.shutdown()


if __name__ == "__main__":
    main()
