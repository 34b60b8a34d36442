#!/usr/bin/env python
"""Allreduce latency and bus bandwidth: hora against torch.distributed (gloo) and mpi4py.

    python benchmarks/allreduce.py                      # full run: 4 B .. 256 MiB, N = 2 and 4
    python benchmarks/allreduce.py --quick              # smoke run (about 10 s)
    python benchmarks/allreduce.py --np 2 --max-size 16M --json /tmp/ar.json

Every library reduces the same float32 buffers with op Sum, in the same run, each rank a
separate process: hora through ``hora.runner.run``, gloo through ``multiprocessing`` (spawn)
and ``init_process_group("gloo")`` on a free port, mpi4py through ``mpiexec`` when both are
available.  Per size and library:

1. one allreduce of known inputs, checked on every rank (a wrong sum fails that job, so a
   broken run reports no numbers for it);
2. warm-up iterations, whose slowest rank's mean time sets the number of timed iterations
   (the same on every rank) so that one round takes about ``--round-s`` seconds;
3. ``--rounds`` rounds, each: barrier, then timed iterations; a round's time is the max over
   ranks of the per-iteration mean; the reported time is the median over rounds (fewer rounds
   when they would take longer than ``--size-budget-s``).

Bandwidth follows nccl-tests: algbw = bytes / time, busbw = algbw * 2(N-1)/N (GB = 1e9 B).
The same run measures the machine's limits: numpy copy and add rates and one loopback TCP
stream.  Timings are not assertions: the exit status is 0 when every job ran and verified,
1 when one failed (its cells say FAILED), 2 on bad arguments.
"""
import argparse
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
import traceback

import numpy as np

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_SIZES = [4, 64, KiB, 16 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
QUICK_SIZES = [4, 16 * KiB, MiB]
DEFAULT_JSON = os.path.join(tempfile.gettempdir(), "hora-bench", "allreduce.json")
LIBS = ("hora", "gloo", "mpi")      # also the order of the table's columns
MIN_ITERS, MAX_ITERS = 3, 2000      # per round, unless --size-budget-s says fewer
JOB_TIMEOUT_S = 480.0               # one (library, N) job: a hang fails that job, not the run
_UNITS = {"": 1, "B": 1, "K": KiB, "KB": KiB, "KIB": KiB, "M": MiB, "MB": MiB, "MIB": MiB,
          "G": GiB, "GB": GiB, "GIB": GiB}


# -- what every rank runs, whatever the library --------------------------------------------
class ResultMismatch(RuntimeError):
    """An allreduce returned the wrong sum: the library (or its setup) is broken."""


def _verify_input(n, rank):
    """Rank ``rank``'s known input: (rank + 1) + (i % 13); small integers, exact in float32."""
    return (np.arange(n, dtype=np.int64) % 13 + (rank + 1)).astype(np.float32)


def _expected_sum(n, size):
    return (np.arange(n, dtype=np.int64) % 13 * size + size * (size + 1) // 2).astype(np.float32)


def _warmup_count(nbytes):
    return 10 if nbytes <= 64 * KiB else 3 if nbytes <= 4 * MiB else 1


def _measure_size(comm, nbytes, plan):
    """Verify, warm up and time one size; returns ``{"bytes", "iters", "round_s"}``."""
    n = max(1, nbytes // 4)
    got = comm.to_numpy(comm.allreduce(comm.prepare(_verify_input(n, comm.rank)), nbytes))
    want = _expected_sum(n, comm.size)
    if got.shape != want.shape or not np.array_equal(got, want):
        bad = int(np.flatnonzero(got.reshape(-1) != want)[0]) if got.shape == want.shape else -1
        raise ResultMismatch(
            f"rank {comm.rank}: allreduce of {nbytes} B returned a wrong sum (first bad index "
            f"{bad}: got {got.reshape(-1)[bad] if bad >= 0 else got.shape}, want "
            f"{want[bad] if bad >= 0 else want.shape})")
    buf = comm.prepare(np.zeros(n, dtype=np.float32))   # zeros: in-place results stay finite
    warm = _warmup_count(nbytes)
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(warm):
        comm.allreduce(buf, nbytes)
    per_iter = comm.max((time.perf_counter() - t0) / warm)     # same on every rank
    iters = min(MAX_ITERS, max(MIN_ITERS, int(plan["round_s"] // per_iter)))
    rounds, budget = plan["rounds"], plan["size_budget_s"]
    if iters * per_iter * rounds > budget:      # large sizes: give up iterations, then rounds
        iters = max(1, int(budget // (rounds * per_iter)))
        rounds = max(1, min(rounds, int(budget // (iters * per_iter))))
    times = []
    for _ in range(rounds):
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            comm.allreduce(buf, nbytes)
        times.append((time.perf_counter() - t0) / iters)
    return {"bytes": nbytes, "iters": iters, "round_s": times}


def _measure(comm, plan):
    return [_measure_size(comm, nbytes, plan) for nbytes in plan["sizes"]]


class _HoraComm:
    """hora's NumPy API; one fixed name per size, as a training step reuses its names."""

    def __init__(self):
        import hora
        self._hora = hora
        hora.init()
        self.rank, self.size = hora.rank(), hora.size()

    def prepare(self, array):
        return array

    def allreduce(self, buf, nbytes):
        return self._hora.allreduce(buf, op=self._hora.Sum, name=f"bench.{nbytes}")

    def to_numpy(self, result):
        return result

    def barrier(self):
        self._hora.barrier()

    def max(self, x):
        return float(self._hora.allreduce(np.array([x]), op=self._hora.Max, name="bench.max")[0])

    def close(self):
        self._hora.shutdown()


class _GlooComm:
    """torch.distributed with the gloo backend; ``all_reduce`` works in place on a tensor."""

    def __init__(self, rank, size, port, timeout_s):
        import datetime
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)    # as hora: one reducing thread per rank
        self._torch, self._dist = torch, dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size, timeout=datetime.timedelta(seconds=timeout_s))
        self.rank, self.size = rank, size

    def prepare(self, array):
        return self._torch.from_numpy(array.copy())

    def allreduce(self, buf, nbytes):
        self._dist.all_reduce(buf, op=self._dist.ReduceOp.SUM)
        return buf

    def to_numpy(self, result):
        return result.numpy()

    def barrier(self):
        self._dist.barrier()

    def max(self, x):
        t = self._torch.tensor([x], dtype=self._torch.float64)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX)
        return float(t[0])

    def close(self):
        self._dist.destroy_process_group()


class _MpiComm:
    """mpi4py's buffer API, out of place into a preallocated array."""

    def __init__(self):
        from mpi4py import MPI
        self._mpi, self._comm = MPI, MPI.COMM_WORLD
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()

    def prepare(self, array):
        return array, np.empty_like(array)

    def allreduce(self, bufs, nbytes):
        self._comm.Allreduce(bufs[0], bufs[1], op=self._mpi.SUM)
        return bufs[1]

    def to_numpy(self, result):
        return result

    def barrier(self):
        self._comm.Barrier()

    def max(self, x):
        return self._comm.allreduce(x, op=self._mpi.MAX)

    def close(self):
        pass


# -- worker entry points ---------------------------------------------------------------------
def _hora_job(plan):
    """Runs on every rank of a hora.runner.run job."""
    comm = _HoraComm()
    try:
        return _measure(comm, plan)
    finally:
        comm.close()


def _gloo_worker(rank, size, port, plan, results):
    """Target of one spawned gloo rank; puts ``(rank, "ok"|"error", payload)`` on ``results``."""
    try:
        comm = _GlooComm(rank, size, port, plan["job_timeout_s"])
        try:
            results.put((rank, "ok", _measure(comm, plan)))
        finally:
            comm.close()
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, "error", traceback.format_exc()))


def _mpi_worker_main(plan_path, out_path):
    """``allreduce.py --mpi-worker PLAN OUT`` under mpiexec: rank 0 writes every rank's result."""
    with open(plan_path) as f:
        plan = json.load(f)
    comm = _MpiComm()
    per_rank = comm._comm.gather(_measure(comm, plan), root=0)
    if comm.rank == 0:
        with open(out_path, "w") as f:
            json.dump(per_rank, f)


# -- launching one job per (library, N) -------------------------------------------------------
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_hora(n, plan):
    import hora.runner
    return hora.runner.run(_hora_job, args=(plan,), np=n, timeout_s=plan["job_timeout_s"])


def _run_gloo(n, plan):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_gloo_worker, args=(r, n, port, plan, results), daemon=True)
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
    try:
        version = subprocess.run([exe, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    flags = []
    if "Open MPI" in version or "OpenRTE" in version:
        flags.append("--oversubscribe")
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            flags.append("--allow-run-as-root")
    return [exe, *flags]


def _run_mpi(n, plan, launcher):
    with tempfile.TemporaryDirectory(prefix="hora-bench-mpi-") as tmp:
        plan_path, out_path = os.path.join(tmp, "plan.json"), os.path.join(tmp, "out.json")
        with open(plan_path, "w") as f:
            json.dump(plan, f)
        cmd = [*launcher, "-n", str(n), sys.executable, os.path.abspath(__file__),
               "--mpi-worker", plan_path, out_path]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=plan["job_timeout_s"])
        if proc.returncode != 0 or not os.path.exists(out_path):
            raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n"
                               f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
        with open(out_path) as f:
            return json.load(f)


def _summarize(per_rank, n):
    """Per size: the median over rounds of the slowest rank's per-iteration mean."""
    rows = []
    for by_rank in zip(*per_rank):
        nbytes = by_rank[0]["bytes"]
        rounds = [max(r["round_s"][i] for r in by_rank) for i in range(len(by_rank[0]["round_s"]))]
        t = statistics.median(rounds)
        algbw = nbytes / t / 1e9
        rows.append({"bytes": nbytes, "time_s": t, "latency_us": t * 1e6, "algbw_gbps": algbw,
                     "busbw_gbps": algbw * 2 * (n - 1) / n, "iters": by_rank[0]["iters"],
                     "rounds_s": rounds})
    return rows


# -- the machine's limits ---------------------------------------------------------------------
def _best_rate(fn, nbytes, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def _numpy_rates(nbytes, reps):
    """GB/s of np.copyto (bytes copied) and of an in-place np.add (bytes of the output)."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    b = np.ones_like(a)
    dst = np.empty_like(a)
    np.copyto(dst, a)                   # fault the pages in before timing
    copy = _best_rate(lambda: np.copyto(dst, a), nbytes, reps)
    b.fill(0.0)                         # a += 0: stays finite over the repetitions
    add = _best_rate(lambda: np.add(a, b, out=a), nbytes, reps)
    return copy, add


def _tcp_sink(port, nbytes):
    """Target of the receiving process: read ``nbytes`` from 127.0.0.1:port, then ack."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        buf = memoryview(bytearray(4 * MiB))
        for _ in range(2):              # one warm-up transfer, one timed
            left = nbytes
            while left:
                n = s.recv_into(buf[:min(left, len(buf))])
                if n == 0:
                    return
                left -= n
            s.sendall(b"k")


def _tcp_rate(nbytes):
    """GB/s of one loopback TCP stream between two processes (default socket options)."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        sink = mp.get_context("spawn").Process(target=_tcp_sink,
                                               args=(srv.getsockname()[1], nbytes), daemon=True)
        sink.start()
        srv.settimeout(60.0)
        conn, _ = srv.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        chunk = memoryview(bytearray(4 * MiB))
        rates = []
        for _ in range(2):
            t0 = time.perf_counter()
            left = nbytes
            while left:
                conn.sendall(chunk[:min(left, len(chunk))])
                left -= min(left, len(chunk))
            conn.recv(1)
            rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    sink.join(10.0)
    return rates[-1]


def measure_limits(quick):
    copy_bytes, tcp_bytes = (64 * MiB, 128 * MiB) if quick else (256 * MiB, GiB)
    copy, add = _numpy_rates(copy_bytes, 3 if quick else 5)
    return {"numpy_copy_gbps": copy, "numpy_add_gbps": add, "numpy_bytes": copy_bytes,
            "tcp_stream_gbps": _tcp_rate(tcp_bytes), "tcp_bytes": tcp_bytes}


# -- output ----------------------------------------------------------------------------------
def _fmt_size(nbytes):
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _fmt_us(us):
    return f"{us:.1f}" if us < 100 else f"{us:,.0f}"


def _fmt_gbps(x):
    return f"{x:.3f}" if x >= 0.01 else f"{x:.2g}"


def print_table(results, libs, nps, sizes, out=sys.stdout):
    """One row per (N, size); ``results[lib][n]`` is a list of rows or ``{"error": ...}``."""
    head = ["size", "N"]
    for lib in libs:
        head += [f"{lib} latency (us)", f"{lib} busbw (GB/s)"]
    others = [lib for lib in libs if lib != "hora"]
    head += [f"speedup vs {lib} (t_{lib}/t_hora)" for lib in others if "hora" in libs]
    print("| " + " | ".join(head) + " |", file=out)
    print("|" + "|".join("---:" for _ in head) + "|", file=out)
    for n in nps:
        by_lib = {lib: _rows_by_size(results[lib].get(n)) for lib in libs}
        for size in sizes:
            cells = [_fmt_size(size), str(n)]
            for lib in libs:
                row = by_lib[lib].get(size)
                cells += ([_fmt_us(row["latency_us"]), _fmt_gbps(row["busbw_gbps"])] if row
                          else ["FAILED", "FAILED"])
            mine = by_lib.get("hora", {}).get(size)
            for lib in others if "hora" in libs else []:
                theirs = by_lib[lib].get(size)
                cells.append(f"{theirs['time_s'] / mine['time_s']:.2f}x" if mine and theirs
                             else "-")
            print("| " + " | ".join(cells) + " |", file=out)


def _rows_by_size(job):
    if not isinstance(job, list):
        return {}
    return {row["bytes"]: row for row in job}


def print_limits(limits, out=sys.stdout):
    print(f"machine: {os.cpu_count()} CPUs, {platform.platform()}, Python "
          f"{platform.python_version()}, numpy {np.__version__}", file=out)
    print(f"- numpy copy (np.copyto, {_fmt_size(limits['numpy_bytes'])}): "
          f"{limits['numpy_copy_gbps']:.2f} GB/s copied (memory traffic is 2x)", file=out)
    print(f"- numpy add (np.add out=a, {_fmt_size(limits['numpy_bytes'])}): "
          f"{limits['numpy_add_gbps']:.2f} GB/s of output (memory traffic is 3x)", file=out)
    print(f"- loopback TCP, one stream between two processes ({_fmt_size(limits['tcp_bytes'])}):"
          f" {limits['tcp_stream_gbps']:.2f} GB/s", file=out)


# -- command line ------------------------------------------------------------------------------
def parse_size(text):
    """'4', '64B', '16K', '1MiB', '2G' -> bytes (binary units)."""
    t = text.strip().upper()
    digits = t.rstrip("BKMGI")
    unit = t[len(digits):]
    if not digits.isdigit() or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: expected e.g. 4, 64B, 16K, 1MiB")
    return int(digits) * _UNITS[unit]


def _size_list(text):
    return [parse_size(s) for s in text.replace(",", " ").split()]


def build_parser():
    p = argparse.ArgumentParser(
        description="Allreduce (float32, Sum) latency and bus bandwidth: hora vs gloo vs mpi4py.")
    p.add_argument("--np", type=int, nargs="+", default=[2, 4], metavar="N",
                   help="numbers of ranks (default: 2 4)")
    p.add_argument("--sizes", type=_size_list, default=None,
                   help="message sizes, e.g. '4,1K,1M' (default: 4 B, 64 B, 1 KiB, 16 KiB, "
                        "256 KiB, 1 MiB, 4 MiB, 16 MiB, 64 MiB, 256 MiB)")
    p.add_argument("--max-size", type=parse_size, default=None, help="drop sizes above this")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: sizes 4 B, 16 KiB, 1 MiB; 1 round; small limit tests")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per size (default 3)")
    p.add_argument("--round-s", type=float, default=None,
                   help="target seconds per timed round (default 0.4; quick 0.05)")
    p.add_argument("--size-budget-s", type=float, default=12.0,
                   help="seconds the timed rounds of one size may take: beyond it, fewer "
                        "iterations per round, then fewer rounds (default 12)")
    p.add_argument("--libs", nargs="+", default=list(LIBS), choices=LIBS,
                   help="libraries to run (default: every one that is available)")
    p.add_argument("--job-timeout-s", type=float, default=JOB_TIMEOUT_S,
                   help=f"limit for one (library, N) job (default {JOB_TIMEOUT_S:g})")
    p.add_argument("--no-limits", action="store_true", help="skip the memcpy/add/TCP tests")
    p.add_argument("--json", default=DEFAULT_JSON, metavar="PATH",
                   help=f"write results here (default {DEFAULT_JSON})")
    p.add_argument("--mpi-worker", nargs=2, metavar=("PLAN", "OUT"), help=argparse.SUPPRESS)
    return p


def _plan(args):
    sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    if args.max_size is not None:
        sizes = [s for s in sizes if s <= args.max_size]
    return {"sizes": sorted(set(sizes)),
            "rounds": args.rounds or (1 if args.quick else 3),
            "round_s": args.round_s or (0.05 if args.quick else 0.4),
            "size_budget_s": args.size_budget_s,
            "job_timeout_s": args.job_timeout_s}


def _available_libs(wanted):
    """(libraries to run, {library: why skipped})."""
    libs, skipped = [], {}
    for lib in wanted:
        if lib == "gloo" and importlib.util.find_spec("torch") is None:
            skipped[lib] = "torch is not importable"
        elif lib == "mpi" and importlib.util.find_spec("mpi4py") is None:
            skipped[lib] = "mpi4py is not importable"
        elif lib == "mpi" and _mpiexec() is None:
            skipped[lib] = "mpi4py is importable but no mpiexec/mpirun is on PATH"
        else:
            libs.append(lib)
    return libs, skipped


def run_jobs(libs, nps, plan):
    """``{lib: {N: rows or {"error": text}}}``, printing progress to stderr."""
    mpi_launcher = _mpiexec() if "mpi" in libs else None
    runners = {"hora": _run_hora, "gloo": _run_gloo,
               "mpi": lambda n, p: _run_mpi(n, p, mpi_launcher)}
    results = {lib: {} for lib in libs}
    for n in nps:
        for lib in libs:
            t0 = time.monotonic()
            try:
                results[lib][n] = _summarize(runners[lib](n, plan), n)
                status = "ok"
            except Exception as e:  # noqa: BLE001 - a failed job is reported, not fatal
                results[lib][n] = {"error": f"{type(e).__name__}: {e}"}
                status = f"FAILED: {type(e).__name__}: {e}"
            print(f"[bench] {lib} N={n}: {time.monotonic() - t0:.1f} s, {status}",
                  file=sys.stderr, flush=True)
    return results


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.mpi_worker:
        _mpi_worker_main(*args.mpi_worker)
        return 0
    if min(args.np) < 2:
        build_parser().error(f"--np: every N must be at least 2, got {args.np}")
    for flag, value in (("--rounds", args.rounds), ("--round-s", args.round_s),
                        ("--size-budget-s", args.size_budget_s),
                        ("--job-timeout-s", args.job_timeout_s)):
        if value is not None and value <= 0:
            build_parser().error(f"{flag} must be positive, got {value}")
    plan = _plan(args)
    if not plan["sizes"]:
        build_parser().error("no sizes left to run (check --sizes / --max-size)")
    started = time.monotonic()
    libs, skipped = _available_libs([lib for lib in LIBS if lib in args.libs])
    for lib, why in skipped.items():
        print(f"[bench] skipping {lib}: {why}", file=sys.stderr)
    limits = None if args.no_limits else measure_limits(args.quick)
    results = run_jobs(libs, list(dict.fromkeys(args.np)), plan)
    if limits is not None:
        print_limits(limits)
    if max(args.np) > (os.cpu_count() or 1):
        print(f"note: N={max(args.np)} ranks share {os.cpu_count()} CPUs (oversubscribed)")
    print("speedup = t_other / t_hora: above 1 hora is faster (for large sizes it equals the "
          "busbw ratio hora/other); busbw = bytes/time * 2(N-1)/N, GB = 1e9 B\n")
    print_table(results, libs, list(dict.fromkeys(args.np)), plan["sizes"])
    elapsed = time.monotonic() - started
    _write_json(args.json, {
        "benchmark": "allreduce", "dtype": "float32", "op": "Sum", "argv": sys.argv[1:],
        "plan": plan, "skipped": skipped, "limits": limits, "results": results,
        "elapsed_s": elapsed, "machine": _machine()})
    print(f"\n{elapsed:.0f} s in all; results written to {args.json}")
    failed = [f"{lib} N={n}" for lib in libs for n, r in results[lib].items() if "error" in r]
    if failed:
        print(f"FAILED: {', '.join(failed)} (see the messages above)", file=sys.stderr)
        return 1
    return 0


def _machine():
    info = {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "numpy": np.__version__,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    for dist in ("hora", "torch", "mpi4py"):
        try:
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            info[dist] = None
    return info


def _write_json(path, data):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    sys.exit(main())
