#!/usr/bin/env python
"""MXNet on one host: hora's allreduce against MXNet's parameter server (dist_sync).

    python benchmarks/mxnet_ps_vs_allreduce.py              # 3 rounds at N = 2 and 4 (6-8 minutes)
    python benchmarks/mxnet_ps_vs_allreduce.py --quick      # 1 short round (~1.5 minutes)
    python benchmarks/mxnet_ps_vs_allreduce.py --np 2 --servers 2 --systems hora ps

Horovod's MXNet claim is that ring-allreduce scales better than MXNet's own parameter
server.  This trains the same Gluon MLP on scikit-learn's digits (8x8 images, 10 classes),
with the same batch per worker, seed, learning rate and thread count, as:

- ``single``: one process, a plain ``gluon.Trainer`` (no kvstore): the baseline;
- ``hora``: ``hora.mxnet.DistributedTrainer`` after ``hora.mxnet.broadcast_parameters``,
  N ranks started by ``hora run`` with its default data plane (shared memory on one host);
- ``hora-tcp``: the same over hora's TCP ring (``hora run --backend tcp``), the
  ring-allreduce of Horovod's claim, on the loopback interface like the parameter server;
- ``ps``: a ``gluon.Trainer`` on ``kvstore='dist_sync'``, MXNet's parameter server: one
  scheduler, ``--servers`` server processes and N workers, all local processes told their
  role through ``DMLC_ROLE`` and friends.  A server or scheduler is a process that imports
  ``mxnet`` with its role set: ``mxnet.kvstore.kvstore_server`` runs the server loop at
  import and exits when the workers are done.  As Gluon does by default on a ``dist``
  kvstore, the optimizer runs on the servers (``update_on_kvstore``): workers push
  gradients and pull weights.

With ``--hora-api numpy``, or when ``hora.mxnet`` is not importable (the run says why),
hora's rows reduce the gradients through hora's NumPy API (``hora.grouped_allreduce`` on
``.asnumpy()`` copies) under a plain ``gluon.Trainer`` instead, and their labels say so.

Both distributed systems average the gradients of the N workers (hora's trainer divides
by N; the workers of the parameter server pass the global batch to ``step``), so every
system trains the same model the same way; each run checks that its workers end with the
same weights.  Every process gets one thread for MXNet's engine and one for OpenMP, so a
worker is one core's worth, like the single process.

Each round runs every configuration once (every other round in reverse order); the table
is the median over rounds of samples per second (all workers together, from a barrier
after the warm-up to the last worker's end) and the scaling efficiency
throughput(N) / (N x throughput(1)).  Every configuration has a deadline (``--timeout-s``);
its processes each run in their own process group, all killed at its end; ports are picked
free.  Other processes distort the numbers: each run prints the share of the CPUs they
used meanwhile (from ``/proc/stat``).

When MXNet's parameter server cannot run here (a build without the distributed kvstore),
its rows say FAILED and the run prints MXNet's own error.  Exit status 0 when every run
finished, 1 otherwise.
"""
import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from _cpu import others_share  # the benchmarks folder is sys.path[0]

from hora.runner.proc import parent_death_hook

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_JSON = os.path.join(tempfile.gettempdir(), "hora-bench", "mxnet_ps_vs_allreduce.json")
DEFAULT_PLOT = os.path.join(tempfile.gettempdir(), "hora-bench", "mxnet_ps_vs_allreduce.png")
# one core's worth per process: MXNet's CPU engine threads, OpenMP and BLAS
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1",
              "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
# between SIGTERM and SIGKILL of a process group at teardown: longer than hora run's own
# grace (3 s), so that the launcher gets to stop its ranks itself
GRACE_S = 6.0
DIGITS = 1797           # rows of scikit-learn's digits
# system -> (label, hora's --backend); every system but "single" runs at each N
SYSTEMS = {"single": ("one process (baseline)", None),
           "hora": ("hora, shared memory", "auto"),
           "hora-tcp": ("hora, TCP ring", "tcp"),
           "ps": ("MXNet parameter server (dist_sync)", None)}
WORKER_KINDS = ("single", "hora", "hora-numpy", "ps")


# ---- the worker: one training process of any system -------------------------------------

def _digits_shard(rank, size):
    """scikit-learn's digits as float32 in [0, 1], this worker's rows (every size-th)."""
    import numpy as np
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    return (x[rank::size] / 16.0).astype(np.float32), y[rank::size].astype(np.float32)


def _model(hidden, layers):
    from mxnet.gluon import nn
    net = nn.HybridSequential()
    for _ in range(layers):
        net.add(nn.Dense(hidden, activation="relu"))
    net.add(nn.Dense(10))
    return net


class _Comm:
    """What differs between the systems in a worker: rank, size, trainer, step size, barrier."""

    def __init__(self, kind):
        import mxnet as mx
        self.kind = kind
        if kind == "ps":
            self.kv = mx.kv.create("dist_sync")
            self.rank, self.size = self.kv.rank, self.kv.num_workers
        elif kind in ("hora", "hora-numpy"):
            if kind == "hora":
                import hora.mxnet as hvd
            else:
                import hora as hvd
            hvd.init()
            self.hvd, self.rank, self.size = hvd, hvd.rank(), hvd.size()
        else:
            self.rank, self.size = 0, 1

    def trainer(self, params, opt_params):
        from mxnet import gluon
        if self.kind == "ps":
            return gluon.Trainer(params, "sgd", opt_params, kvstore=self.kv)
        if self.kind == "hora":
            self.hvd.broadcast_parameters(params, root_rank=0)
            return self.hvd.DistributedTrainer(params, "sgd", opt_params)
        if self.kind == "hora-numpy":
            self._broadcast_numpy(params)
        return gluon.Trainer(params, "sgd", opt_params, kvstore=None)

    def step(self, trainer, params, batch):
        if self.kind == "ps":
            # the servers sum the N workers' gradients: dividing by the global batch averages
            trainer.step(batch * self.size)
            return
        if self.kind == "hora-numpy":
            self._average_grads_numpy(params)
        trainer.step(batch)

    def barrier(self):
        import mxnet as mx
        if self.kind == "ps":
            self.kv._barrier()      # KVStore's barrier of the workers is private
        elif self.kind == "hora":
            self.hvd.allreduce(mx.nd.zeros(1), name="barrier").asnumpy()
        elif self.kind == "hora-numpy":
            self.hvd.barrier()

    def _broadcast_numpy(self, params):
        for name, p in sorted(params.items()):
            p.set_data(self.hvd.broadcast(p.data().asnumpy(), root_rank=0, name=name))

    def _average_grads_numpy(self, params):
        named = sorted(params.items())
        grads = self.hvd.grouped_allreduce([p.grad().asnumpy() for _, p in named],
                                           op=self.hvd.Average)
        for (_, p), g in zip(named, grads):
            p.grad()[:] = g     # from NumPy directly: through mx.nd.array(g) took 3x as long


def _worker(args):
    """Train, time the steps after the warm-up, write this worker's report as JSON."""
    import mxnet as mx
    from mxnet import autograd, gluon
    comm = _Comm(args.worker)
    x, y = _digits_shard(comm.rank, comm.size)
    mx.random.seed(args.seed)
    net = _model(args.hidden, args.layers)
    net.initialize(mx.init.Xavier())
    net(mx.nd.array(x[:1]))             # shapes known: parameters exist before broadcast
    net.hybridize()
    params = net.collect_params()
    trainer = comm.trainer(params, {"learning_rate": args.lr * comm.size, "momentum": 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    xs, ys = mx.nd.array(x), mx.nd.array(y)
    n, b = len(x), args.batch_size

    def one_step(i):
        lo = (i * b) % (n - b)
        data, label = xs[lo:lo + b], ys[lo:lo + b]
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        comm.step(trainer, params, b)

    for i in range(args.warmup):
        one_step(i)
    mx.nd.waitall()
    comm.barrier()
    t0, cpu0 = time.monotonic(), time.process_time()
    for i in range(args.warmup, args.warmup + args.steps):
        one_step(i)
    mx.nd.waitall()
    t1, cpu1 = time.monotonic(), time.process_time()
    report = {"rank": comm.rank, "size": comm.size, "t0": t0, "t1": t1, "cpu_s": cpu1 - cpu0,
              "steps": args.steps, "batch": b,
              "weight_sums": [float(p.data().asnumpy().astype("float64").sum())
                              for _, p in sorted(params.items())]}
    with open(os.path.join(args.out, f"rank{comm.rank}.json"), "w") as f:
        json.dump(report, f)
    if args.worker == "ps":
        comm.barrier()      # no worker leaves (and finalises the kvstore) before all wrote


# ---- the driver: processes, rounds, table, plot -----------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Group:
    """Processes of one configuration, each in its own session (process group): killed
    together at the end, so no scheduler, server or rank outlives its run.  Each also gets
    SIGKILL if this driver dies first (Linux's parent-death signal, hora's launcher's hook)."""

    def __init__(self, workdir):
        self.workdir, self.procs = workdir, []

    def spawn(self, name, cmd, env):
        log = open(os.path.join(self.workdir, f"{name}.log"), "w")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                             env={**os.environ, **THREAD_ENV, **env}, start_new_session=True,
                             preexec_fn=parent_death_hook())
        log.close()
        self.procs.append((name, p))
        return p

    def wait(self, procs, deadline, what):
        """Wait until every one of ``procs`` has exited, at most until the monotonic
        ``deadline`` (``what`` names it).  Raises RuntimeError, with its output, as soon as
        any process of the group fails (a parameter server's scheduler that cannot start
        fails before its workers notice), or naming one still running at the deadline."""
        while True:
            for name, p in self.procs:
                if p.poll() not in (None, 0):
                    raise RuntimeError(f"{name} exited {p.returncode}; its output:\n"
                                       f"{self.log(name)}")
            running = [name for name, p in self.procs if p in procs and p.poll() is None]
            if not running:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{running[0]} still running after {what}; its output:\n"
                                   f"{self.log(running[0])}")
            time.sleep(0.05)

    def log(self, name, chars=3000):
        with open(os.path.join(self.workdir, f"{name}.log"), errors="replace") as f:
            return f.read()[-chars:] or "(none)"

    def kill(self):
        """SIGTERM every group still alive, a grace period, then SIGKILL."""
        alive = [p for _, p in self.procs if p.poll() is None]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in alive:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            end = time.monotonic() + GRACE_S
            for p in alive:
                try:
                    p.wait(timeout=max(0.0, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            alive = [p for p in alive if p.poll() is None]
            if not alive:
                return


def _worker_cmd(kind, args, out):
    return [sys.executable, os.path.abspath(__file__), "--worker", kind, "--out", out,
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--batch-size", str(args.batch_size), "--hidden", str(args.hidden),
            "--layers", str(args.layers), "--lr", str(args.lr), "--seed", str(args.seed)]


def _launch(system, n, args, workdir, hora_kind):
    """Start one configuration, wait for it, return the workers' reports; always kills
    every process it started."""
    out = tempfile.mkdtemp(prefix=f"{system}{n}-", dir=workdir)
    group = _Group(out)
    deadline = time.monotonic() + args.timeout_s
    try:
        if system == "single":
            workers = [group.spawn("worker", _worker_cmd("single", args, out), {})]
        elif system == "ps":
            workers = _launch_ps(group, n, args, out)
        else:
            # hora's launcher kills its ranks itself after --timeout; ours is the backstop
            cmd = [sys.executable, "-m", "hora", "run", "-np", str(n), "--timeout",
                   str(int(args.timeout_s)), "--backend", SYSTEMS[system][1],
                   *_worker_cmd(hora_kind, args, out)]
            workers = [group.spawn("hora-run", cmd, {})]
        group.wait(workers, deadline, f"--timeout-s {args.timeout_s:g}")
        if system == "ps":      # the scheduler and servers leave once every worker has
            group.wait([p for _, p in group.procs], time.monotonic() + 10,
                       "the workers by 10 s")
    finally:
        group.kill()
    reports = []
    for r in range(n):
        path = os.path.join(out, f"rank{r}.json")
        if not os.path.exists(path):
            raise RuntimeError(f"rank {r} wrote no report; logs:\n" + "\n".join(
                group.log(name, 1500) for name, _ in group.procs))
        with open(path) as f:
            reports.append(json.load(f))
    return reports


def _launch_ps(group, n, args, out):
    env = {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(_free_port()),
           "DMLC_NODE_HOST": "127.0.0.1", "DMLC_NUM_SERVER": str(args.servers),
           "DMLC_NUM_WORKER": str(n)}
    # importing mxnet with DMLC_ROLE=scheduler|server runs that role's loop, then exits
    role = [sys.executable, "-c", "import mxnet"]
    group.spawn("scheduler", role, {**env, "DMLC_ROLE": "scheduler"})
    for s in range(args.servers):
        group.spawn(f"server{s}", role, {**env, "DMLC_ROLE": "server"})
    return [group.spawn(f"worker{w}", _worker_cmd("ps", args, out),
                        {**env, "DMLC_ROLE": "worker"}) for w in range(n)]


def _measure(reports):
    """Samples per second of all workers, whether their final weights agree, and the CPUs
    the workers kept busy (their CPU time over the timed steps' wall time)."""
    start = min(r["t0"] for r in reports)
    end = max(r["t1"] for r in reports)
    samples = sum(r["steps"] * r["batch"] for r in reports)
    ref = reports[0]["weight_sums"]
    agree = all(abs(a - b) <= 1e-4 * (1 + abs(a))
                for r in reports for a, b in zip(ref, r["weight_sums"]))
    return samples / (end - start), agree, sum(r["cpu_s"] for r in reports) / (end - start)


def _timed_launch(system, n, args, workdir, hora_kind):
    """``_launch`` and ``_measure``, plus the share of the CPUs that processes other than
    ours used meanwhile (None where /proc/stat is unreadable)."""
    (rate, agree, cpus), others = others_share(
        lambda: _measure(_launch(system, n, args, workdir, hora_kind)))
    return rate, agree, cpus, others


def _hora_kind(args):
    """The worker kind of hora's rows, and a note when it is not hora.mxnet's trainer."""
    if args.hora_api == "numpy":
        return "hora-numpy", None
    probe = subprocess.run([sys.executable, "-c", "import hora.mxnet as h; h.DistributedTrainer; "
                            "h.broadcast_parameters"], capture_output=True, text=True,
                           timeout=120, env={**os.environ, **THREAD_ENV})
    if probe.returncode == 0:
        return "hora", None
    why = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
    return "hora-numpy", f"hora.mxnet is not usable ({why}); hora's NumPy API instead"


def _label(system, hora_kind):
    if system == "single" or system == "ps":
        return SYSTEMS[system][0]
    how = ("hora.mxnet.DistributedTrainer" if hora_kind == "hora"
           else "hora's NumPy API on .asnumpy() gradients")
    return f"{SYSTEMS[system][0]} ({how})"


def _rounds(configs, args, hora_kind):
    results = {c: [] for c in configs}
    cpus = {c: [] for c in configs}
    errors, others = {}, []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hora-mxps-") as workdir:
        for r in range(args.rounds):
            spent = time.monotonic() - started
            if r and spent + spent / r > args.budget_s:
                print(f"stopping after {r} round(s): another would pass --budget-s "
                      f"{args.budget_s:g}", file=sys.stderr)
                break
            # every other round reversed: the machine's drift falls on every configuration
            for system, n in (configs if r % 2 == 0 else configs[::-1]):
                if (system, n) in errors:
                    continue
                tag = f"[round {r + 1}] {system}/{n}"
                try:
                    rate, agree, used, busy = _timed_launch(system, n, args, workdir,
                                                            hora_kind)
                except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                    errors[(system, n)] = str(e)
                    print(f"{tag} FAILED: {e}", file=sys.stderr, flush=True)
                    continue
                if not agree:
                    errors[(system, n)] = "the workers ended with different weights"
                    print(f"{tag} FAILED: {errors[(system, n)]}", file=sys.stderr, flush=True)
                    continue
                results[(system, n)].append(rate)
                cpus[(system, n)].append(used)
                others.append(busy)
                print(f"{tag}: {rate:.0f} samples/s" + (
                    "" if busy is None else f" (other processes: {100 * busy:.0f}% of the "
                    f"CPUs)"), file=sys.stderr, flush=True)
    return results, cpus, errors, others, time.monotonic() - started


def table(medians, nps, systems, hora_kind):
    """Markdown: per system, samples/s and scaling efficiency at each N."""
    one = medians.get(("single", 1))
    head = "| system | " + " | ".join(f"N={n} samples/s | N={n} efficiency" for n in nps) + " |"
    lines = [head, "|---|" + "---:|---:|" * len(nps),
             f"| {_label('single', hora_kind)} | {_fmt(one)} (N=1) | 100% (N=1) |"
             + " |" * (2 * len(nps) - 2)]
    for system in systems:
        cells = []
        for n in nps:
            rate = medians.get((system, n))
            eff = "FAILED" if rate is None or one is None else f"{100 * rate / (n * one):.1f}%"
            cells += [_fmt(rate), eff]
        lines.append(f"| {_label(system, hora_kind)} | " + " | ".join(cells) + " |")
    ratios = [f"{system} / parameter server at N={n}: {a / b:.2f}x"
              for system in systems if system != "ps" for n in nps
              for a, b in [(medians.get((system, n)), medians.get(("ps", n)))] if a and b]
    return "\n".join(lines + ([""] + ratios if ratios else []))


def _fmt(x):
    return "FAILED" if x is None else f"{x:.0f}"


def plot(medians, nps, systems, hora_kind, path, title):
    """Throughput and scaling efficiency against N, one line per system; False without
    matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    one = medians.get(("single", 1))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3.8))
    for system, marker in zip(systems, "o^sd"):
        pts = [(n, medians[(system, n)]) for n in nps if medians.get((system, n))]
        if not pts:
            continue
        ns = [1] + [n for n, _ in pts] if one else [n for n, _ in pts]
        rates = ([one] if one else []) + [r for _, r in pts]
        ax1.plot(ns, rates, marker=marker, label=_label(system, hora_kind))
        if one:
            ax2.plot([n for n, _ in pts], [100 * r / (n * one) for n, r in pts], marker=marker,
                     label=_label(system, hora_kind))
    if one:
        # N processes cannot get more than the machine's CPUs: beyond them, the ceiling is flat
        cpus, ns = os.cpu_count() or 1, [1] + list(nps)
        ax1.plot(ns, [one * min(n, cpus) for n in ns], "k:", lw=1,
                 label=f"linear scaling up to the {cpus} CPUs")
        ax2.plot(list(nps), [100 * min(n, cpus) / n for n in nps], "k:", lw=1)
    ax1.set(xlabel="workers", ylabel="samples/s (all workers)", xticks=[1] + list(nps))
    ax2.set(xlabel="workers", ylabel="scaling efficiency (%)", xticks=list(nps), ylim=(0, 110))
    fig.legend(*ax1.get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=7,
               frameon=False)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def _ps_support():
    """None when this MXNet was built with the distributed kvstore, else why not."""
    import mxnet
    if mxnet.runtime.Features().is_enabled("DIST_KVSTORE"):
        return None
    return f"mxnet {mxnet.__version__} was built without DIST_KVSTORE (mxnet.runtime.Features())"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--np", type=int, nargs="+", default=[2, 4], help="worker counts")
    parser.add_argument("--servers", type=int, default=1, help="parameter-server processes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=600.0,
                        help="start no new round once this would be passed")
    parser.add_argument("--steps", type=int, default=150, help="timed steps per worker")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    parser.add_argument("--batch-size", type=int, default=128, help="per worker")
    parser.add_argument("--hidden", type=int, default=1024, help="width of the hidden layers")
    parser.add_argument("--layers", type=int, default=2, help="hidden layers")
    parser.add_argument("--lr", type=float, default=0.02, help="per worker (x N, as Horovod)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", nargs="+", choices=[s for s in SYSTEMS if s != "single"],
                        default=[s for s in SYSTEMS if s != "single"],
                        help="besides the one-process baseline")
    parser.add_argument("--hora-api", choices=["mxnet", "numpy"], default="mxnet",
                        help="hora.mxnet's DistributedTrainer, or hora's NumPy API on the "
                             "gradients (the fallback when hora.mxnet is not importable)")
    parser.add_argument("--timeout-s", type=float, default=120.0,
                        help="deadline of each configuration's processes")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 1 round of 40 timed steps")
    parser.add_argument("--json", default=DEFAULT_JSON, metavar="PATH")
    parser.add_argument("--plot", default=DEFAULT_PLOT, metavar="PATH")
    parser.add_argument("--worker", choices=WORKER_KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 40, 10
    if min(args.np) < 2 or args.servers < 1:
        parser.error(f"--np needs counts >= 2 (got {args.np}), --servers >= 1 "
                     f"(got {args.servers})")
    if args.batch_size >= DIGITS // max(args.np):
        parser.error(f"--batch-size {args.batch_size}: a worker's shard of the {DIGITS} "
                     f"digits at N={max(args.np)} holds fewer rows")
    try:
        why_no_ps = _ps_support()
    except ImportError as e:
        print(f"mxnet is not importable here ({e}): pip install mxnet==1.9.1 'numpy<1.24'",
              file=sys.stderr)
        return 1
    hora_kind, note = _hora_kind(args)
    if note:
        print(note, file=sys.stderr)
    if why_no_ps:
        print(f"MXNet's parameter server cannot run here: {why_no_ps}", file=sys.stderr)
    nps = sorted(set(args.np))
    configs = [("single", 1)] + [(system, n) for n in nps for system in args.systems]
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
          f"{args.rounds} round(s) of {', '.join(f'{s}/{n}' for s, n in configs)}",
          file=sys.stderr)
    load_before = os.getloadavg()[0]
    results, cpus, errors, others, elapsed = _rounds(configs, args, hora_kind)
    medians = {c: statistics.median(v) for c, v in results.items() if v and c not in errors}
    _report(args, nps, hora_kind, results, cpus, errors, others, elapsed, load_before,
            why_no_ps)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"rounds": {f"{s}/{n}": v for (s, n), v in results.items()},
                   "worker_cpus": {f"{s}/{n}": v for (s, n), v in cpus.items()},
                   "medians": {f"{s}/{n}": v for (s, n), v in medians.items()},
                   "errors": {f"{s}/{n}": e for (s, n), e in errors.items()},
                   "others_cpu_share": others, "args": vars(args), "cpus": os.cpu_count(),
                   "platform": platform.platform(), "hora_note": note, "seconds": elapsed},
                  f, indent=1)
    print(f"(every round's numbers: {args.json})", file=sys.stderr)
    return 1 if errors else 0


def _report(args, nps, hora_kind, results, worker_cpus, errors, others, elapsed, load_before,
            why_no_ps):
    """Print the table and what it needs for reading; draw the plot."""
    medians = {c: statistics.median(v) for c, v in results.items() if v and c not in errors}
    rounds = max(len(v) for v in results.values())
    cpus = os.cpu_count() or 1
    h = args.hidden
    params = 65 * h + (args.layers - 1) * (h + 1) * h + (h + 1) * 10
    title = (f"MLP 64-{'-'.join([str(h)] * args.layers)}-10 ({params / 1e6:.2f} M parameters)"
             f" on digits, batch {args.batch_size} per worker, {args.servers} server(s), "
             f"{cpus} CPUs")
    shares = [b for b in others if b is not None]
    load = (f"; other processes used {100 * statistics.mean(shares):.0f}% of the CPUs"
            if shares else "")
    print(f"{title}; samples/s of all workers, median of the rounds, {args.steps} timed "
          f"steps per worker\n")
    print(table(medians, nps, args.systems, hora_kind))
    print("\nCPUs kept busy by the workers over the timed steps (their CPU time / wall time; "
          "the parameter server's server and scheduler not counted): " + ", ".join(
              f"{s}/{n} {statistics.median(v):.2f}" for (s, n), v in worker_cpus.items() if v))
    if max(nps) > cpus:
        print(f"\n(N={max(nps)} workers on {cpus} CPUs: oversubscribed; the parameter "
              f"server's {args.servers} server(s) and its scheduler are further processes)")
    print(f"\nload average (1 min): {load_before:.2f} before, {os.getloadavg()[0]:.2f} after; "
          f"{elapsed:.0f} s" + (f"; other processes used {100 * statistics.mean(shares):.0f}% "
                                f"of the CPUs on average during the runs (max "
                                f"{100 * max(shares):.0f}%)" if shares else ""))
    for (system, n), e in errors.items():
        print(f"\n{system}/{n} FAILED: {e}")
    if why_no_ps:
        print(f"\nMXNet's parameter server cannot run here: {why_no_ps}")
    if plot(medians, nps, args.systems, hora_kind, args.plot,
            f"{title}\nmedian of {rounds} round(s) of {args.steps} steps{load}"):
        print(f"(plot: {args.plot})", file=sys.stderr)
    else:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
