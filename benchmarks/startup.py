"""Start-up time on one host, with torch imported: ``hora run -np 2`` beside ``torchrun`` and
``horovodrun`` (when Horovod is importable).

    python benchmarks/startup.py [--np 2] [--repeats 5] [--json PATH]

Every launcher starts the same kind of script: import torch and the library, join the job,
reduce one tensor, and (rank 0) print the wall-clock time at which that first allreduce
completed.  Two times per run, both from the moment the launcher is started:

- ``first allreduce``: until the first collective has completed on rank 0, what a user waits
  for before training starts;
- ``exit``: until the launcher has exited (teardown included).

The floor is ``python -c "import torch"`` (one process): no launcher can start a torch
script sooner.  Runs are interleaved (one of each launcher per round) so that a slow
moment of the machine does not fall on one launcher only; the table gives medians and
the ratio to each peer (the target: hora <= 0.65x torchrun's and horovodrun's).

hora's own modules are byte-compiled first (``compileall``), as installing a wheel does:
torch and Horovod come compiled, and an editable install of hora under
``PYTHONDONTWRITEBYTECODE=1`` would otherwise compile its sources in every run.
"""
import argparse
import compileall
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

MARK = "HORA-STARTUP-DONE"

HORA = f"""
import time, torch, hora.torch as hvd
hvd.init()
out = hvd.allreduce(torch.ones(1000), op=hvd.Sum, name="first")
assert float(out[0]) == hvd.size(), out
if hvd.rank() == 0:
    print("{MARK}", repr(time.time()), flush=True)
hvd.shutdown()
"""

TORCHRUN = f"""
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1000)
dist.all_reduce(t)
assert float(t[0]) == dist.get_world_size(), t
if dist.get_rank() == 0:
    print("{MARK}", repr(time.time()), flush=True)
dist.destroy_process_group()
"""

HOROVOD = f"""
import time, torch, horovod.torch as hvd
hvd.init()
out = hvd.allreduce(torch.ones(1000), op=hvd.Sum, name="first")
assert float(out[0]) == hvd.size(), out
if hvd.rank() == 0:
    print("{MARK}", repr(time.time()), flush=True)
hvd.shutdown()
"""


def _horovod_missing():
    try:
        import horovod.torch  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure means: not runnable here
        return f"Horovod is not importable ({type(e).__name__}: {e})"
    if not shutil.which("horovodrun"):
        return "horovodrun is not on PATH"
    return None


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _once(argv, env, timeout_s=120):
    """(seconds to the first allreduce, seconds to exit) of one launch, within ``timeout_s``."""
    start_wall, start = time.time(), time.monotonic()
    # a session of its own: on a timeout the launcher's workers are killed with it
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"{' '.join(argv)} did not finish within {timeout_s:g} s") from None
    total = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n"
                           f"{out[-2000:]}{err[-2000:]}")
    for line in out.splitlines():
        if MARK in line:
            return float(line.split(MARK, 1)[1].split()[0]) - start_wall, total
    raise RuntimeError(f"{' '.join(argv)} printed no completion mark:\n{out[-2000:]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HORA_", "OMPI_", "HOROVOD_"))
           and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    py = sys.executable
    import hora
    compileall.compile_dir(os.path.dirname(hora.__file__), quiet=1)
    with tempfile.TemporaryDirectory() as tmp:
        scripts = {}
        for name, text in (("hora", HORA), ("torchrun", TORCHRUN), ("horovod", HOROVOD)):
            scripts[name] = os.path.join(tmp, f"job_{name}.py")  # "hora.py" would shadow hora
            with open(scripts[name], "w") as f:
                f.write(text)
        n = str(args.np)
        rows = {
            f"hora run -np {n}": [py, "-m", "hora", "run", "-np", n, py, scripts["hora"]],
            f"torchrun --nproc-per-node {n}": [py, "-m", "torch.distributed.run",
                                                "--nproc-per-node", n, "--master-port",
                                                "{port}", scripts["torchrun"]],
        }
        skipped = {}
        why = _horovod_missing()
        if why is None:
            rows[f"horovodrun -np {n} --gloo"] = ["horovodrun", "-np", n, "--gloo", py,
                                                 scripts["horovod"]]
        else:
            skipped[f"horovodrun -np {n} --gloo"] = why
        floor = []
        times = {name: [] for name in rows}
        failed = {}
        for r in range(args.repeats):
            start = time.monotonic()
            subprocess.run([py, "-c", "import torch"], env=env, check=True)
            floor.append(time.monotonic() - start)
            for name, argv in rows.items():
                if name in failed:
                    continue
                try:
                    times[name].append(_once([a.format(port=_free_port()) for a in argv], env))
                except RuntimeError as e:
                    failed[name] = str(e)
                    print(f"{name}: FAILED: {e}", file=sys.stderr)
            print(f"round {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)

    med = {name: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts))
           for name, ts in times.items() if ts}
    hora_name = f"hora run -np {n}"
    print(f"\nstart-up on one host, {args.np} ranks, torch imported, medians of "
          f"{args.repeats} interleaved runs ({os.cpu_count()} CPUs, Python "
          f"{sys.version.split()[0]})\n")
    print(f"`python -c \"import torch\"` (the floor, one process): "
          f"{statistics.median(floor):.2f} s\n")
    print("| launcher | first allreduce (s) | exit (s) | hora / this (first allreduce) |")
    print("|---|---:|---:|---:|")
    for name in rows:
        if name not in med:
            print(f"| {name} | FAILED | FAILED | – |")
            continue
        first, total = med[name]
        ratio = (f"{med[hora_name][0] / first:.2f}x" if hora_name in med and name != hora_name
                 else "–")
        print(f"| {name} | {first:.2f} | {total:.2f} | {ratio} |")
    for name, why in skipped.items():
        print(f"| {name} | n/a | n/a | {why} |")
    if hora_name in med:
        print(f"\nhora beyond the floor: {med[hora_name][0] - statistics.median(floor):.2f} s "
              f"to the first allreduce")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"np": args.np, "repeats": args.repeats, "floor_s": floor,
                       "runs": times, "failed": failed, "skipped": skipped}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
