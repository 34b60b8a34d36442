"""A Hugging Face Accelerate training script on backend "hora", run by
test_torch_dist_accelerate.py as a user runs one: ``hora run -np 2 python accelerate_job.py
OUT_DIR [--linger S]``.

It trains the same model twice in one job, from the same seed on the same data: first with
the default group on backend hora, then (that group destroyed, Accelerate's state reset) on
gloo.  Each run is what an Accelerate script does: ``accelerator.prepare(model, optimizer,
dataloader)`` (DDP, the loader sharded by rank), ``accelerator.backward``, the per-rank losses
and sample indices through ``accelerator.gather``, a sum through ``accelerator.reduce``,
``wait_for_everyone``.  Each rank writes ``OUT_DIR/rank<r>.json``: per backend, what
Accelerate made of the job, the gathered numbers and the final parameters.  ``--linger S``:
the ranks stay ``S`` seconds on backend hora after training, so that ``hora run --monitor``
(whose table takes a rank's new status once a second) shows their last collectives.

How Accelerate 1.16 is given backend hora: ``dist.init_process_group("hora")`` before
``Accelerator(cpu=True)``, which finds the group made and uses it (its ``state.backend`` still
says "gloo").  On CPU it makes only "gloo" or "mpi" groups itself:
``InitProcessGroupKwargs(backend="hora")`` raises with ``cpu=True``; without ``cpu=True`` (on
a machine without an accelerator) it makes the hora group but takes the job for a
non-distributed one: the loader is sharded, the model is not wrapped in DDP and ``gather``
returns each rank's own tensor, so the ranks train apart without a word.

The model and the data are plain functions that the test imports for its one-process
oracle; Accelerate and hora.torch are imported in :func:`main` only.
"""
import json
import os
import sys

import torch

SEED = 4321
STEPS = 3
PER_RANK = 4                 # the loader's batch size: each rank's share of a step
RANKS = 2
SAMPLES = STEPS * PER_RANK * RANKS
LR = 0.1


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(SEED)
        self.fc1 = torch.nn.Linear(5, 8)
        self.fc2 = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def data():
    """(index, x, y) of every sample, the same on every rank."""
    g = torch.Generator().manual_seed(SEED)
    return torch.arange(SAMPLES), torch.randn(SAMPLES, 5, generator=g), \
        torch.randn(SAMPLES, 2, generator=g)


def optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def flat(params):
    return torch.cat([p.detach().reshape(-1) for p in params]).tolist()


def _train(backend, linger_s=0.0, **init):
    import time

    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from torch.utils.data import DataLoader, TensorDataset

    dist.init_process_group(backend, **init)
    accelerator = Accelerator(cpu=True)
    state = accelerator.state
    model = Net()
    model, opt, loader = accelerator.prepare(
        model, optimizer(model.parameters()),
        DataLoader(TensorDataset(*data()), batch_size=PER_RANK, shuffle=False))
    losses, seen = [], []
    for index, x, y in loader:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        losses.append(accelerator.gather(loss.detach()).tolist())
        seen.append(accelerator.gather(index).tolist())
    steps = accelerator.reduce(torch.tensor([float(len(seen))]), "sum").item()
    accelerator.wait_for_everyone()
    time.sleep(linger_s)
    out = {"group": dist.get_backend(), "distributed_type": str(state.distributed_type),
           "num_processes": state.num_processes, "process_index": state.process_index,
           "wrapped": type(model).__name__, "losses": losses, "seen": seen, "steps": steps,
           "params": flat(accelerator.unwrap_model(model).parameters())}
    AcceleratorState._reset_state(reset_partial_state=True)
    dist.destroy_process_group()
    return out


def main(argv):
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--linger", type=float, default=0.0)
    args = parser.parse_args(argv)
    import hora.torch  # noqa: F401 - registers "hora"; sets RANK, WORLD_SIZE, ... from hora run's
    torch.set_num_threads(1)
    # hora's group meets at hora run's MASTER_ADDR and MASTER_PORT (env://), as a user's
    # does; gloo's in a file: a second env:// on the same port could meet the first group's
    # store before rank 0 has closed it
    store = os.path.join(args.out_dir, "gloo.store")
    results = {"hora": _train("hora", args.linger),
               "gloo": _train("gloo", init_method=f"file://{store}",
                              rank=int(os.environ["RANK"]),
                              world_size=int(os.environ["WORLD_SIZE"]))}
    rank = results["hora"]["process_index"]
    with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1:])
