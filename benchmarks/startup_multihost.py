"""Start-up time: ``hora run -np 4`` across 2 namespace hosts (real sshd) beside ``mpirun -np 4``.

    sudo python benchmarks/startup_multihost.py [--repeats 5]

Each launcher runs the same script (``hora.init()``, one allreduce, ``hora.shutdown()``) and
the time is the launcher's wall time from start to exit: host checks, ssh logins, Python
start-up, ``import hora``, rendezvous, mesh connections and teardown.  Needs root (network
namespaces, tests/netns.py), OpenSSH's sshd, and Open MPI's mpirun with mpi4py.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import netns  # noqa: E402

SCRIPT = """
import numpy as np, hora
hora.init()
out = hora.allreduce(np.ones(1000, dtype=np.float32), op=hora.Sum, name="x")
assert out[0] == hora.size(), out[0]
hora.shutdown()
"""


def _time(argv, env, repeats):
    times = []
    for _ in range(repeats):
        start = time.monotonic()
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed:\n{done.stdout}{done.stderr}")
        times.append(time.monotonic() - start)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    reason = netns.unavailable_reason()
    if reason:
        raise SystemExit(f"cannot make namespace hosts: {reason}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "OMPI_"))}
    mpi_env = dict(env, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    with tempfile.TemporaryDirectory() as tmp, netns.Cluster(["ok", "ok"]) as cluster:
        script = os.path.join(tmp, "job.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        hora = [sys.executable, "-m", "hora", "run", "-np", "4", "--timeout", "90"]
        rows = [
            ("hora run -np 4 -H a:2,b:2 (2 namespace hosts, sshd)",
             hora + ["-H", f"{cluster.host(0)}:2,{cluster.host(1)}:2", *cluster.ssh_args(),
                     sys.executable, script], env),
            ("hora run -np 4 (one host)", hora + [sys.executable, script], env),
        ]
        if shutil.which("mpirun"):
            # the hosts' ssh logins do not have this Python's bin on PATH: --prefix finds prted
            prefix = os.path.dirname(os.path.dirname(os.path.realpath(shutil.which("mpirun"))))
            rsh = (f"-i {cluster.key} -o StrictHostKeyChecking=no "
                   f"-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR")
            rows += [
                ("mpirun -np 4 -H a:2,b:2 (2 namespace hosts, sshd)",
                 ["mpirun", "-np", "4", "-H", f"{cluster.host(0)}:2,{cluster.host(1)}:2",
                  "--prefix", prefix, "--mca", "plm_rsh_args", rsh, "-x", "PATH",
                  sys.executable, script], mpi_env),
                ("mpirun -np 4 (one host)", ["mpirun", "--oversubscribe", "-np", "4",
                                             sys.executable, script], mpi_env),
                ("hora run --mpi -np 4 (one host)", hora[:4] + ["--mpi"] + hora[4:] +
                 [sys.executable, script], mpi_env),
            ]
        print(f"start-up to exit, seconds, {args.repeats} runs each "
              f"({os.cpu_count()} CPUs, Python {sys.version.split()[0]})\n")
        print(f"| {'launcher':<52} | median | min  | max  |")
        print(f"|{'-' * 54}|--------|------|------|")
        for name, argv, run_env in rows:
            t = _time(argv, run_env, args.repeats)
            print(f"| {name:<52} | {statistics.median(t):6.2f} | {min(t):4.2f} | "
                  f"{max(t):4.2f} |", flush=True)


if __name__ == "__main__":
    main()
