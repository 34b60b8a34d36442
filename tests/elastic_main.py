"""An elastic PyTorch training script for the elastic tests and benchmarks/elastic_recovery.py
(run as a script under ``hora run``; :func:`run_worker` is the same training as a function,
for executors that call one: ``hora.ray.ElasticRayExecutor``).

A small MLP on a fixed synthetic regression set, SGD with momentum, trained with
``hvd.elastic.run`` over an ElasticSampler.  The *global* batch is fixed (ELASTIC_GLOBAL_BATCH,
default 12: divisible by 1, 2, 3, 4 and 6), and each rank takes ``global / size()`` samples a
step, so that every step averages the gradient of the same 12 samples whatever the number of
workers: the final weights then equal those of one process training on those global
batches in the same order (:func:`reference_weights`), however workers come and go.

Environment:
  ELASTIC_OUT         rank 0 writes the report (JSON) here at the end
  ELASTIC_KILL        "R:E:B[,R:E:B...]": the worker that is rank R in the job's first round
                      kills itself (SIGKILL) before batch B of epoch E; ``R`` may be ``w<N>``
                      for the worker named N whatever its rank
  ELASTIC_GROW        "E:B:PATH:TEXT": rank 0 writes TEXT (\\n for newlines) to PATH before
                      batch B of epoch E (a discovery script's host list), once
  ELASTIC_EPOCHS, ELASTIC_SAMPLES, ELASTIC_GLOBAL_BATCH, ELASTIC_COMMIT_EVERY
  ELASTIC_HOLD        "E:B:N[,E:B:N...]": before batch B of epoch E, every rank commits every
                      0.2 s until the job has N workers (a joiner re-forms it at such a
                      commit), for at most 60 s: what would otherwise depend on how fast a
                      new worker imports torch
  ELASTIC_STEP_LOG    rank 0 appends "<unix time> <size> <epoch> <batch>" per step here
  ELASTIC_STEP_SLEEP  seconds each step of the job's first round (round 0) sleeps: stretches
                      that round so that a test can act on the launcher while it runs;
                      workers of later rounds train at full speed
  ELASTIC_REPORT      "1": before each step rank 0 passes {"epoch", "batch", "size"} to
                      hora.ray.report (under hora.ray's executors)
"""
import json
import os
import random
import signal
import time

import numpy as np
import torch

EPOCHS = int(os.environ.get("ELASTIC_EPOCHS", "3"))
SAMPLES = int(os.environ.get("ELASTIC_SAMPLES", "96"))
GLOBAL_BATCH = int(os.environ.get("ELASTIC_GLOBAL_BATCH", "12"))
COMMIT_EVERY = int(os.environ.get("ELASTIC_COMMIT_EVERY", "2"))
SEED = 1


def dataset():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, 8)).astype(np.float32)
    w = rng.standard_normal((8, 1)).astype(np.float32)
    y = np.tanh(x @ w) + 0.1 * rng.standard_normal((SAMPLES, 1)).astype(np.float32)
    return torch.from_numpy(x), torch.from_numpy(y)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def epoch_order(epoch):
    """ElasticSampler's order of an epoch (shuffle=True, seed=SEED)."""
    order = list(range(SAMPLES))
    random.Random(SEED + epoch).shuffle(order)
    return order


def reference_weights():
    """One process, the same global batches in the same order."""
    x, y = dataset()
    model = make_model()
    opt = make_optimizer(model.parameters())
    for epoch in range(EPOCHS):
        order = epoch_order(epoch)
        for start in range(0, SAMPLES, GLOBAL_BATCH):
            idx = order[start:start + GLOBAL_BATCH]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
            opt.step()
    return [p.detach().numpy().ravel().tolist() for p in model.parameters()]


def check_training(report, reference):
    """A test's checks of a report against :func:`reference_weights`: each epoch's committed
    samples are the dataset once, and the weights are the reference's to float tolerance."""
    for epoch, seen in enumerate(report["seen_epochs"]):
        assert sorted(seen) == list(range(SAMPLES)), \
            f"epoch {epoch}: samples skipped or seen twice"
    assert len(report["seen_epochs"]) == EPOCHS
    for got, want in zip(report["weights"], reference):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)


def check_kept_pids(report):
    """Every final rank's process recorded the same pid in each round it trained in."""
    for entries in report["pids"]:
        assert len({pid for _, _, pid in entries}) == 1, entries


def _kills():
    out = []
    for item in filter(None, os.environ.get("ELASTIC_KILL", "").split(",")):
        who, epoch, batch = item.split(":")
        out.append((who, int(epoch), int(batch)))
    return out


def run_worker():
    """Train as one worker of an elastic job (``hvd.init()`` included), leave the job, and
    return this worker's report: the final weights, the committed samples and sizes, the
    final size, round and rank, and every final rank's ``(round, rank, pid)`` per round."""
    import hora.torch as hvd
    from hora.core import membership

    hvd.init()
    x, y = dataset()
    model = make_model()
    opt = hvd.DistributedOptimizer(make_optimizer(model.parameters()),
                                   named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(torch.utils.data.TensorDataset(x, y), shuffle=True,
                                         seed=SEED)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, batch=0, seen=[],
                                   seen_epochs=[], sizes=[])
    rounds = []             # this process's own (round, rank, pid) each time train() starts
    kills = _kills()
    grow = os.environ.get("ELASTIC_GROW")
    grown = [False]
    step_log = os.environ.get("ELASTIC_STEP_LOG")
    sleep_s = float(os.environ.get("ELASTIC_STEP_SLEEP", "0"))
    me = os.environ.get("HORA_ELASTIC_ID")

    holds = [tuple(map(int, item.split(":")))
             for item in filter(None, os.environ.get("ELASTIC_HOLD", "").split(","))]
    report_steps = os.environ.get("ELASTIC_REPORT") == "1"

    def maybe_hold(epoch, batch):
        n = next((n for e, b, n in holds if (e, b) == (epoch, batch)), None)
        if n is None:
            return
        deadline = time.monotonic() + 60
        while hvd.size() != n and time.monotonic() < deadline:
            time.sleep(0.2)
            state.commit()          # raises HostsUpdatedInterrupt once the joiner is ready

    def maybe_act(epoch, batch):
        maybe_hold(epoch, batch)
        first_round = membership.current_round() == 0
        for who, e, b in kills:
            if (e, b) != (epoch, batch):
                continue
            if (who == f"w{me}") or (first_round and who == str(hvd.rank())):
                print(f"worker {me} (rank {hvd.rank()}) kills itself at epoch {e} batch {b}",
                      flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        if grow and not grown[0] and hvd.rank() == 0:
            e, b, path, text = grow.split(":", 3)
            if (int(e), int(b)) == (epoch, batch):
                with open(path, "w") as f:
                    f.write(text.replace("\\n", "\n"))
                grown[0] = True

    @hvd.elastic.run
    def train(state):
        rounds.append((membership.current_round(), hvd.rank(), os.getpid()))
        while state.epoch < EPOCHS:
            per_rank = GLOBAL_BATCH // hvd.size()
            assert per_rank * hvd.size() == GLOBAL_BATCH, (GLOBAL_BATCH, hvd.size())
            mine = list(iter(sampler))
            for start in range(0, len(mine), per_rank):
                if report_steps and hvd.rank() == 0:
                    from hora.ray import report
                    report({"epoch": state.epoch, "batch": state.batch, "size": hvd.size()})
                maybe_act(state.epoch, state.batch)
                idx = mine[start:start + per_rank]
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
                opt.step()
                everyone = hvd.allgather_object(idx)
                state.seen.extend(i for part in everyone for i in part)
                state.sizes.append(hvd.size())
                sampler.record_batch(0, per_rank)
                state.batch += 1
                if step_log and hvd.rank() == 0:
                    with open(step_log, "a") as f:
                        f.write(f"{time.time():.6f} {hvd.size()} {state.epoch} "
                                f"{state.batch}\n")
                if sleep_s and membership.current_round() == 0:
                    time.sleep(sleep_s)
                if state.batch % COMMIT_EVERY == 0:
                    state.commit()
            state.seen_epochs.append(state.seen)
            state.seen = []
            state.epoch += 1
            state.batch = 0
            sampler.set_epoch(state.epoch)
            state.commit()
        return state

    done = train(state)
    pids = hvd.allgather_object(rounds)
    report = {"weights": [p.detach().numpy().ravel().tolist() for p in model.parameters()],
              "seen_epochs": done.seen_epochs, "sizes": done.sizes,
              "final_size": hvd.size(), "round": membership.current_round(),
              "rank": hvd.rank(), "pids": pids}
    hvd.shutdown()
    return report


def main():
    report = run_worker()
    if report["rank"] == 0 and os.environ.get("ELASTIC_OUT"):
        with open(os.environ["ELASTIC_OUT"], "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
