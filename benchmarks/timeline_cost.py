#!/usr/bin/env python
"""What the timeline costs a loop of tiny allreduces: ``hora.allreduce`` of one float32
(4 bytes, Sum) on one host, with the timeline off and on, in the same job.

    python benchmarks/timeline_cost.py                  # -np 2, 15 repeats of 10,000 calls
    python benchmarks/timeline_cost.py --np 4 --calls 50000 --repeats 5

Every repeat times ``--calls`` calls with the timeline off and as many with it on
(``hora.start_timeline`` on every rank before, ``hora.stop_timeline`` after: rank 0 writes
every rank's events), in an order that alternates from one repeat to the next, each after a
barrier.  It prints each repeat's microseconds a call, both ways (rank 0's clock), the
median of each and their ratio, and the median of the repeats' ratios (a machine shared
with other work slows some repeats several times over: the pairs of one repeat ran within
a second of each other); and, from the last trace, which phases rank 0's row of the loop
holds (with the timeline on, the board's rounds: ``ALLREDUCE board``).  (A worker's events
recorded after its last send are lost when the timeline stops.)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def worker(calls, repeats, folder):
    import numpy as np
    import hora
    from hora.core.build_info import start_timeline, stop_timeline
    hora.init()
    x = np.ones(1, np.float32)
    for _ in range(2000):                               # warm up the lane
        hora.allreduce(x, name="loss", op=hora.Sum)
    times = {"off": [], "on": []}
    for i in range(repeats):
        for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
            path = os.path.join(folder, f"trace{i}.json")
            if mode == "on":
                start_timeline(path)
            hora.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                hora.allreduce(x, name="loss", op=hora.Sum)
            times[mode].append((time.perf_counter() - t0) / calls * 1e6)
            hora.barrier()
            if mode == "on":
                stop_timeline()
    if hora.rank() == 0:
        print(json.dumps(times), flush=True)
    hora.shutdown()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--calls", type=int, default=10000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.calls, args.repeats, args.folder)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, "-m", "hora", "run", "-np", str(args.np), sys.executable,
                os.path.abspath(__file__), "--worker", "--calls", str(args.calls),
                "--repeats", str(args.repeats), "--folder", tmp]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1200,
                              stdin=subprocess.DEVNULL, cwd=ROOT)
        if done.returncode != 0:
            sys.exit(f"the job failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
        line = [ln for ln in done.stdout.splitlines() if "{" in ln][-1]
        times = json.loads(line[line.index("{"):])
        sys.path.insert(0, ROOT)
        from hora.core import timeline
        events = timeline.load(os.path.join(tmp, f"trace{args.repeats - 1}.json"))
    print(f"hora.allreduce of 4 B (float32 Sum), -np {args.np}, {args.calls} calls a repeat, "
          f"{os.cpu_count()} CPUs; microseconds a call")
    for i, (off, on) in enumerate(zip(times["off"], times["on"])):
        print(f"  repeat {i + 1}: off {off:7.2f}  on {on:7.2f}")
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    ratios = [b / a for a, b in zip(times["off"], times["on"])]
    print(f"median: off {off:.2f} us, on {on:.2f} us, on/off {on / off:.3f}; median of the "
          f"repeats' on/off {statistics.median(ratios):.3f}")
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"}
    phases = {}
    for e in events:
        if e.get("ph") == "X" and e["pid"] == 0 and rows.get((0, e["tid"])) == "loss":
            phases[e["name"]] = phases.get(e["name"], 0) + 1
    print(f"the last trace's phases of rank 0's 'loss': {phases}")


if __name__ == "__main__":
    main()
