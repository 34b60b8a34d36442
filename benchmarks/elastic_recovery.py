#!/usr/bin/env python
"""Recovery from a killed worker: hora's elastic training against torchrun's restarts.

    python benchmarks/elastic_recovery.py                     # 3 runs each, one host (~3 min)
    python benchmarks/elastic_recovery.py --repeats 1 --steps 150
    sudo python benchmarks/elastic_recovery.py --netns        # also 2 namespace hosts x 2
    python benchmarks/elastic_recovery.py --np 16 --repeats 1 --steps 300 --kill-at 100

The same PyTorch model (an MLP on synthetic data, 64 samples a rank a step, SGD with
momentum) trains at N=4 (``--np``) under:

- ``hora``: ``hora run -np 4 --min-np 2 --host-discovery-script ... --blacklist-cooldown-range
  3 3``, the training function under ``hvd.elastic.run`` with a ``TorchState`` committed
  every 10 steps.  When a worker dies the survivors restore the last commit and go on at
  N=3 in the same processes; 3 s later (the cooldown) the launcher starts a new worker,
  which joins at a commit: N=4 again.
- ``torchrun``: ``torchrun --standalone --nproc-per-node 4 --max-restarts 3
  --monitor-interval 0.1`` (torchrun's quickest check), DDP over gloo, rank 0 saving a
  checkpoint (model, optimizer, step) every 10 steps.  When a worker dies the agent stops
  every worker and starts 4 new ones, which load the checkpoint.  (Each attempt keys its
  process group under its own prefix of the agent's store: with plain ``env://``, torch
  2.13's restarted workers read the previous attempt's Gloo addresses and never train.)

In both, the worker that is rank 2 kills itself (SIGKILL) at step ``--kill-at`` in its first
life.  Rank 0 logs the wall time of every completed step; the victim logs the time of its
death.  *Recovery* is the time from that death to the first step completed after it, as
the issue defines it: detection, re-forming (or restarting and re-importing), restoring (or
loading the checkpoint) and one step.  *Redone* is the steps between the last commit (or
checkpoint) and the death, trained again.

The table gives the median (min-max) over ``--repeats`` runs and torchrun's median over
hora's; the plot (``--plot``, default benchmarks/figures/elastic_recovery.png) shows samples
per second over time across the failure (and, for hora, the re-join) for the first run of
each.  With ``--netns`` (root, tests/netns.py) hora's job also runs across two namespace
hosts of 2 slots each, over ssh (torchrun's multi-node rendezvous is not set up here).
"""
import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BATCH = 64
COMMIT_EVERY = 10


# -- the worker (python elastic_recovery.py --worker hora|torchrun) -------------------------------
def _model_and_data():
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 256, generator=gen)
    y = torch.randint(0, 10, (4096,), generator=gen)
    return model, x, y


def _log(path, line):
    with open(path, "a") as f:
        f.write(line + "\n")


def _step(model, opt, x, y, step, rank, size):
    import torch
    start = (step * size + rank) * BATCH % (len(x) - BATCH)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x[start:start + BATCH]),
                                      y[start:start + BATCH]).backward()
    opt.step()


def _maybe_die(args, rank, first_life, step):
    if first_life and rank == 2 and step == args.kill_at:
        _log(args.log, f"kill {time.time():.6f} {step}")
        os.kill(os.getpid(), signal.SIGKILL)


def worker_hora(args):
    import torch
    import hora.torch as hvd
    from hora.core import membership
    torch.set_num_threads(1)
    hvd.init()
    model, x, y = _model_and_data()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, step=0)

    @hvd.elastic.run
    def train(state):
        while state.step < args.steps:
            _maybe_die(args, hvd.rank(), membership.current_round() == 0, state.step)
            _step(model, opt, x, y, state.step, hvd.rank(), hvd.size())
            state.step += 1
            if hvd.rank() == 0:
                _log(args.log, f"step {time.time():.6f} {state.step} {hvd.size()} "
                               f"{membership.current_round()}")
            if state.step % COMMIT_EVERY == 0:
                state.commit()

    train(state)
    hvd.shutdown()


def worker_torchrun(args):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # the process group's keys under this attempt's own prefix: with the default env://
    # store, torch 2.13's restarted workers read the previous attempt's addresses here and
    # fail in Gloo's connectFullMesh (or hang), so no restart ever trains
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size,
                          False, timeout=datetime.timedelta(seconds=60))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"/bench/attempt_{attempt}", store),
                            rank=rank, world_size=size)
    model, x, y = _model_and_data()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    step = 0
    if os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        step = saved["step"]
    first_life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    while step < args.steps:
        _maybe_die(args, rank, first_life, step)
        _step(ddp, opt, x, y, step, rank, size)
        step += 1
        if rank == 0:
            _log(args.log, f"step {time.time():.6f} {step} {size} {attempt}")
            if step % COMMIT_EVERY == 0:
                tmp = args.checkpoint + ".tmp"
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                            "step": step}, tmp)
                os.replace(tmp, args.checkpoint)
    dist.destroy_process_group()


# -- the driver ---------------------------------------------------------------------------------
def _parse(log):
    kill, steps = None, []
    with open(log) as f:
        for line in f:
            parts = line.split()
            if parts[0] == "kill":
                kill = (float(parts[1]), int(parts[2]))
            elif parts[0] == "step":        # time, step, size, life (round or attempt)
                steps.append((float(parts[1]), int(parts[2]), int(parts[3]), int(parts[4])))
    return kill, steps


def _measure(log):
    kill, steps = _parse(log)
    if kill is None:
        raise RuntimeError(f"{log}: no worker died")
    t_kill, at = kill
    # the first step of the job's next life (hora's next round, torchrun's next attempt);
    # rank 0 may still log the step before the death just after it
    after = [s for s in steps if s[3] > 0]
    if not after:
        raise RuntimeError(f"{log}: no step completed after the kill")
    first = after[0]
    return {"recovery_s": first[0] - t_kill, "redone": at - (first[1] - 1),
            "size_after": first[2], "kill": t_kill, "steps": [s[:3] for s in steps]}


def _env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HORA_", "HOROVOD_", "OMPI_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_hora(args, tmp, hosts_line=None, ssh=()):
    log = os.path.join(tmp, "hora.log")
    hosts = os.path.join(tmp, "hosts")
    with open(hosts, "w") as f:
        f.write(hosts_line or f"localhost:{args.np}\n")
    n = str(args.np)
    argv = [sys.executable, "-m", "hora", "run", "-np", n, "--min-np", "2", "--max-np", n,
            "--host-discovery-script", f"cat {hosts}", "--blacklist-cooldown-range", "3", "3",
            *ssh, "--timeout", str(args.timeout_s), sys.executable, os.path.abspath(__file__),
            "--worker", "hora", "--step-log", log, "--steps", str(args.steps),
            "--kill-at", str(args.kill_at)]
    _launch(argv, "hora")
    return _measure(log)


def run_torchrun(args, tmp):
    log = os.path.join(tmp, "torchrun.log")
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable),
                                                        "torchrun")
    argv = [torchrun, "--standalone", "--nproc-per-node", str(args.np), "--max-restarts", "3",
            "--monitor-interval", "0.1", os.path.abspath(__file__), "--worker", "torchrun",
            "--step-log", log, "--steps", str(args.steps), "--kill-at", str(args.kill_at),
            "--ckpt-path", os.path.join(tmp, "ckpt.pt")]
    _launch(argv, "torchrun", timeout=args.timeout_s)
    return _measure(log)


def _launch(argv, what, timeout=None):
    done = subprocess.run(argv, env=_env(), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=(timeout or 300) + 30)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def _summary(values):
    return f"{statistics.median(values):6.2f} ({min(values):.2f}-{max(values):.2f})"


def _plot(path, series, n):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot)")
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, m in series:
        t0 = m["kill"]
        times = [t - t0 for t, _, _ in m["steps"]]
        sizes = [s for _, _, s in m["steps"]]
        width = 0.5
        lo, hi = min(times), max(times)
        bins = [lo + i * width for i in range(int((hi - lo) / width) + 2)]
        rate = []
        for b in bins:
            n = sum(size for t, size in zip(times, sizes) if b <= t < b + width)
            rate.append(n * BATCH / width)
        ax.step([b + width for b in bins], rate, where="pre", label=name)
    ax.axvline(0, color="black", linestyle="--", linewidth=1, label="worker killed")
    ax.set_xlabel("seconds from the kill")
    ax.set_ylabel("samples / s (all workers)")
    ax.set_title(f"Throughput across a killed worker (N={n}, one host)")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["hora", "torchrun"], help=argparse.SUPPRESS)
    parser.add_argument("--step-log", dest="log", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt-path", dest="checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=1500, help="steps a run trains")
    parser.add_argument("--kill-at", type=int, default=405, help="step at which rank 2 dies")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--np", type=int, default=4, help="ranks (at least 3: rank 2 dies)")
    parser.add_argument("--timeout-s", type=float, default=240)
    parser.add_argument("--netns", action="store_true",
                        help="also run hora across 2 namespace hosts x 2 slots (root)")
    parser.add_argument("--plot", default=os.path.join(HERE, "figures", "elastic_recovery.png"))
    parser.add_argument("--json", help="write every measurement here")
    args = parser.parse_args()
    if args.np < 3:
        parser.error("--np: at least 3 (rank 2 is the one that dies)")
    if args.worker == "hora":
        return worker_hora(args)
    if args.worker == "torchrun":
        return worker_torchrun(args)
    results = {"hora": [], "torchrun": [], "hora-netns": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for name, fn in (("hora", run_hora), ("torchrun", run_torchrun)):
                where = os.path.join(tmp, f"{name}{i}")
                os.makedirs(where)
                results[name].append(fn(args, where))
                m = results[name][-1]
                print(f"  {name} run {i + 1}: recovery {m['recovery_s']:.2f} s, "
                      f"{m['redone']} step(s) redone, N={m['size_after']} after", flush=True)
        if args.netns:
            sys.path.insert(0, ROOT)
            from tests import netns
            reason = netns.unavailable_reason()
            if reason:
                print(f"(no namespace hosts: {reason})")
            else:
                with netns.Cluster(["ok", "ok"]) as cluster:
                    line = f"{cluster.host(0)}:2\n{cluster.host(1)}:2\n"
                    for i in range(args.repeats):
                        where = os.path.join(tmp, f"netns{i}")
                        os.makedirs(where)
                        m = run_hora(args, where, line, cluster.ssh_args())
                        results["hora-netns"].append(m)
                        print(f"  hora (2 namespace hosts) run {i + 1}: recovery "
                              f"{m['recovery_s']:.2f} s, N={m['size_after']} after",
                              flush=True)
    hora = statistics.median(m["recovery_s"] for m in results["hora"])
    print(f"\nrecovery from a killed worker at N={args.np}, seconds, median (min-max) of "
          f"{args.repeats} runs ({os.cpu_count()} CPUs)\n")
    print("| system | where | recovery s | steps redone | N after | vs hora |")
    print("|---|---|---|---|---|---|")
    rows = [("hora", "one host"), ("torchrun", "one host"), ("hora-netns", "2 ns hosts x 2")]
    for name, where in rows:
        ms = results[name]
        if not ms:
            continue
        rec = [m["recovery_s"] for m in ms]
        print(f"| {name.split('-')[0]} | {where} | {_summary(rec)} | "
              f"{statistics.median(m['redone'] for m in ms):.0f} | {ms[0]['size_after']} | "
              f"{statistics.median(rec) / hora:.1f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)
    if args.plot:
        _plot(args.plot, [("hora (elastic, in-process)", results["hora"][0]),
                          ("torchrun (restart all)", results["torchrun"][0])], args.np)


if __name__ == "__main__":
    main()
