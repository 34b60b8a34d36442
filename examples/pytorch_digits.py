"""Data-parallel training of a small CNN on scikit-learn's digits, in PyTorch, with hora.

    hora run -np 2 python examples/pytorch_digits.py
    hora run -np 2 python examples/pytorch_digits.py --epochs 20 --checkpoint ckpt/digits.pt

A single-process PyTorch script plus the usual Horovod changes, each marked "hora:" below:
init, pin a device by local rank, scale the learning rate by the number of ranks, wrap the
optimizer, broadcast rank 0's initial state, shard the data by rank, average the metrics,
and print / checkpoint on rank 0 only.  ``import hora.torch as hvd`` is the only line that
differs from the same script on Horovod.

With ``--checkpoint PATH``, rank 0 saves the model, the optimizer and the number of finished
epochs after every epoch; started again with the same path, the job resumes after the last
saved epoch (rank 0 loads, every rank receives the state from it).

Every rank takes its ``1/size`` share of each global batch (``DistributedSampler``), so
averaging gradients gives the global batch's gradient: ``-np 2 --batch-size 32 --lr 0.05``
follows ``-np 1 --batch-size 64 --lr 0.1`` up to floating-point rounding.
"""
import argparse
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import hora.torch as hvd

TEST_SIZE = 297                 # a fixed held-out split of the 1797 digits
MEAN, STD = 0.305, 0.376        # of the pixels scaled to [0, 1]


class Net(nn.Module):
    """Two 3x3 convolutions, a 2x2 max-pool and two linear layers: 1x8x8 -> 10 classes."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def datasets():
    """(train, test) TensorDatasets, split the same way on every rank and in every run."""
    digits = load_digits()
    x = torch.tensor((digits.images / 16.0 - MEAN) / STD, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def train_epoch(model, optimizer, loader, device):
    """One pass over this rank's shard; returns this rank's (mean loss, accuracy)."""
    model.train()
    loss_sum, correct, count = 0.0, 0, 0
    for data, target in loader:
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.cross_entropy(output, target)
        loss.backward()
        optimizer.step()       # DistributedOptimizer: waits for the averaged gradients
        loss_sum += loss.item() * len(target)
        correct += (output.argmax(1) == target).sum().item()
        count += len(target)
    return loss_sum / count, correct / count


def evaluate(model, dataset, device):
    """Loss and accuracy on the whole test set: each rank scores its slice, the sums are
    added over the ranks (exact, unlike averaging per-rank means of unequal slices)."""
    model.eval()
    data, target = dataset.tensors
    data, target = data[hvd.rank()::hvd.size()].to(device), target[hvd.rank()::hvd.size()]
    with torch.no_grad():
        output = model(data).cpu()
    sums = torch.tensor([F.cross_entropy(output, target, reduction="sum").item(),
                         (output.argmax(1) == target).sum().item(), len(target)],
                        dtype=torch.float64)
    sums = hvd.allreduce(sums, op=hvd.Sum, name="test_metrics")   # hora: add over ranks
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def save_checkpoint(path, epoch, model, optimizer, test_acc):
    """Write atomically, so a job killed mid-save leaves the previous checkpoint intact."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    torch.save({"epoch": epoch, "model": model.state_dict(),
                "optimizer": optimizer.state_dict(), "test_acc": test_acc}, tmp)
    os.replace(tmp, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="learning rate for one rank; scaled by the number of ranks")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--checkpoint", metavar="PATH",
                        help="save after every epoch; resume from here if it exists")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    hvd.init()                                                    # hora: join the job
    rank, size = hvd.rank(), hvd.size()
    if torch.cuda.is_available():                                 # hora: one device per
        torch.cuda.set_device(hvd.local_rank())                   # local rank
        device = torch.device("cuda", hvd.local_rank())
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)                                  # hora: one core per rank

    torch.manual_seed(args.seed)
    train_set, test_set = datasets()
    sampler = DistributedSampler(train_set, num_replicas=size,    # hora: shard by rank
                                 rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    model = Net().to(device)
    lr = args.lr * size                                           # hora: scale the LR
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum)

    start_epoch = 0
    if rank == 0 and args.checkpoint and os.path.exists(args.checkpoint):  # hora: rank 0
        state = torch.load(args.checkpoint, map_location=device)           # loads...
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"]
        print(f"resuming from {args.checkpoint} after epoch {start_epoch}", flush=True)
    start_epoch = hvd.broadcast_object(start_epoch, root_rank=0,   # hora: ...and every
                                       name="start_epoch")         # rank starts there
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)     # hora: rank 0's weights
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)         # hora: and optimizer state
    optimizer = hvd.DistributedOptimizer(                         # hora: average gradients
        optimizer, named_parameters=model.named_parameters())

    test_acc = None
    for epoch in range(start_epoch, args.epochs):
        for group in optimizer.param_groups:                      # cosine decay, a function
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * epoch / args.epochs))  # of epoch
        sampler.set_epoch(epoch)                                  # hora: a new shuffle, the
        loss, acc = train_epoch(model, optimizer, loader, device)  # same on every rank
        loss, acc = hvd.allreduce(torch.tensor([loss, acc]),      # hora: average the
                                  name="train_metrics").tolist()  # metrics over ranks
        test_loss, test_acc = evaluate(model, test_set, device)
        if rank == 0:                                             # hora: rank 0 reports
            print(f"epoch {epoch + 1:2d}  train loss {loss:.4f}  acc {acc:.3f}  "
                  f"test loss {test_loss:.4f}  acc {test_acc:.3f}  "
                  f"({size} rank{'s' if size > 1 else ''})", flush=True)
            if args.checkpoint:                                   # hora: and checkpoints
                save_checkpoint(args.checkpoint, epoch + 1, model, optimizer, test_acc)
    if rank == 0:
        if test_acc is None:
            print(f"nothing to do: the checkpoint has {start_epoch} epochs, "
                  f"--epochs is {args.epochs}")
        else:
            saved = f", saved {args.checkpoint}" if args.checkpoint else ""
            print(f"final test accuracy {test_acc:.3f}{saved}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
