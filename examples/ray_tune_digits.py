"""Search the learning rate of the digits CNN with Ray Tune, every trial a hora job of 2 workers.

    pip install "ray[tune]"
    python examples/ray_tune_digits.py                          # 3 learning rates, 3 epochs
    python examples/ray_tune_digits.py --lrs 0.01 0.1 --epochs 2 --workers 2

Each trial reserves one CPU per worker (and nothing for the trial itself, which only waits),
starts a :class:`hora.ray.RayExecutor` in that placement group, and runs :func:`train` on
every worker: the training of ``pytorch_digits.py`` (the model, the data split, one epoch,
the evaluation are imported from it), with the learning rate the trial was given.  Rank 0
reports each epoch's metrics with ``hora.ray.tune.report``; they reach Tune as the
trial's results, and the best trial is the one with the highest final test accuracy.

On a 2-CPU machine the trials of 2 workers run one after another.  Give ``--address`` to use
a running Ray cluster instead of starting one.
"""
import argparse
import os
import tempfile

import ray
from ray import tune

from hora.ray.tune import DistributedTrainableCreator

HERE = os.path.dirname(os.path.abspath(__file__))


def train(config):
    """One trial's training, on every worker of its hora job."""
    import torch
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    import hora.torch as hvd
    from hora.ray.tune import report
    from pytorch_digits import Net, datasets, evaluate, train_epoch

    hvd.init()
    torch.set_num_threads(1)                        # one core per rank
    torch.manual_seed(config["seed"])
    train_set, test_set = datasets()
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                 shuffle=True, seed=config["seed"])
    loader = DataLoader(train_set, batch_size=config["batch_size"], sampler=sampler)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"] * hvd.size(),
                                momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    device = torch.device("cpu")
    for epoch in range(config["epochs"]):
        sampler.set_epoch(epoch)
        loss, acc = train_epoch(model, optimizer, loader, device)
        loss, acc = hvd.allreduce(torch.tensor([loss, acc]), name="train_metrics").tolist()
        test_loss, test_acc = evaluate(model, test_set, device)
        report({"epoch": epoch + 1, "train_loss": loss, "train_acc": acc,     # rank 0's
                "test_loss": test_loss, "test_acc": test_acc})                # reach Tune
    hvd.shutdown()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.003, 0.03, 0.3],
                        help="learning rates for one rank (scaled by the number of ranks)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="hora workers per trial")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--address", help="a running Ray cluster (default: start one)")
    parser.add_argument("--num-cpus", type=int, default=None,
                        help="CPUs of the Ray instance started here (default: the machine's)")
    parser.add_argument("--storage", default=None,
                        help="where Tune keeps its results (default: a temporary directory)")
    args = parser.parse_args(argv)

    # the workers import pytorch_digits from this directory
    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(
        filter(None, [HERE, os.environ.get("PYTHONPATH")]))}}
    if args.address:
        ray.init(address=args.address, runtime_env=runtime_env)
    else:
        ray.init(num_cpus=args.num_cpus or os.cpu_count(), include_dashboard=False,
                 object_store_memory=150 * 2**20, runtime_env=runtime_env)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            tuner = tune.Tuner(
                DistributedTrainableCreator(train, num_workers=args.workers, cpus_per_worker=1),
                param_space={"lr": tune.grid_search(args.lrs), "epochs": args.epochs,
                             "batch_size": args.batch_size, "seed": args.seed},
                tune_config=tune.TuneConfig(metric="test_acc", mode="max"),
                run_config=tune.RunConfig(name="hora_digits", verbose=0,
                                          storage_path=os.path.abspath(args.storage or scratch)))
            results = tuner.fit()
            for result in sorted(results, key=lambda r: r.config["lr"]):
                if result.error:
                    print(f"lr {result.config['lr']:<8g} failed: {result.error}", flush=True)
                else:
                    m = result.metrics
                    print(f"lr {result.config['lr']:<8g} test acc {m['test_acc']:.3f}  "
                          f"test loss {m['test_loss']:.4f}  ({m['epoch']} epochs, "
                          f"{args.workers} workers)", flush=True)
            best = results.get_best_result()
            print(f"best lr {best.config['lr']:g}: test accuracy {best.metrics['test_acc']:.3f}",
                  flush=True)
            return 1 if results.errors else 0
    finally:
        ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
