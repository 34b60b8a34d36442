"""Allreduce across hosts: ``hora run`` (hierarchical plane) against ``mpirun``, 2 hosts x 2 ranks.

    sudo python benchmarks/allreduce_multihost.py [--sizes 4,16K,1M,64M] [--launches 3]
                                                  [--per-host 2]

Two network-namespace hosts on a private bridge, each with its own veth link and a real
sshd (tests/netns.py), each running 2 of the job's 4 ranks (``--per-host``: another number
a host; 1 gives each rank a CPU of its own on a 2-CPU machine).  Both systems run the same rank
program, ``python -m hora.bench.ranks SYSTEM PLAN OUT`` (:mod:`hora.bench.ranks`: verify the
sum of known inputs, warm up, time rounds), started by their own launchers over ssh:

- ``hora``: ``hora run -np 4 -H a:2,b:2``, the default data plane (``auto``: across hosts
  the hierarchical plane, shared memory in each host and TCP between them);
- ``mpi``: mpi4py's ``Allreduce`` under ``mpirun -np 4 --host a:2,b:2`` (Open MPI: ob1 with
  the sm BTL in each host and the TCP BTL between them, restricted to the bridge's subnet;
  coll/tuned, ranks that yield while they wait: see :func:`mpi_launcher`).

The launches alternate (hora, MPI, MPI, hora, ...) and each system's rounds are pooled over
its launches as ``hora bench`` pools them (:func:`hora.bench.jobs._summarize`: a round's time
is its slowest rank's, the figure is the median round; busbw = 2(N-1)/N * bytes / t).
Prints a Markdown table with the min-max of the pooled rounds and the issue's two targets,
and writes every round's time to JSON.  Needs root (namespaces), OpenSSH's sshd, and Open
MPI's mpirun with mpi4py.  The namespaces and sshds go on exit, Ctrl-C and failure included.
"""
import argparse
import glob
import json
import os
import shutil
import signal
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from _cpu import others_share  # noqa: E402  (the benchmarks folder is sys.path[0])
from hora.bench import jobs, report  # noqa: E402
from hora.bench.cli import parse_size  # noqa: E402
from tests import netns  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
PER_HOST = 2                # ranks a host, by default: the 2 hosts x 2 ranks
DEFAULT_JSON = os.path.join(tempfile.gettempdir(), "hora-bench", "allreduce_multihost.json")
SYSTEMS = ("hora", "mpi")
LABEL = {"hora": "hora", "mpi": "MPI"}
BUSBW_BYTES, BUSBW_GOAL = 64 * MiB, 1.5     # hora's busbw over MPI's at this size: at least
LATENCY_BYTES, LATENCY_GOAL = 4, 2.0        # hora's latency over MPI's at this size: at most


def _hosts(cluster, per_host):
    """``-H``/``--host``'s list: ``per_host`` ranks on each of the 2 hosts (a number), or the
    ranks of each (a pair)."""
    counts = (per_host, per_host) if isinstance(per_host, int) else per_host
    return ",".join(f"{cluster.host(i)}:{c}" for i, c in enumerate(counts))


def hora_launcher(cluster, job_timeout_s, per_host=PER_HOST):
    """``hora run`` over ssh onto the namespace hosts, the data plane left at its default."""
    hosts = _hosts(cluster, per_host)
    # hora run stops its job (dumping the ranks' tracebacks) before subprocess.run kills it
    return lambda n: [sys.executable, "-m", "hora", "run", "-np", str(n), "-H", hosts,
                      *cluster.ssh_args(), "--timeout", f"{max(10.0, job_timeout_s - 15):g}"]


# Open MPI's agent for the namespace hosts: ssh with the cluster's key, then the remote
# command (PRRTE's prted) in a UTS namespace of its own with a host name of its own.  The
# namespace hosts share this machine's host name and /dev/shm, and Open MPI names its shared
# memory segments after the host name (sm_segment.<host>.<uid>.<job>.<local rank>): without
# this, local rank 0 of both hosts map the same segment, and the job hangs, crashes or
# returns wrong sums.  Real hosts have names of their own; nothing else changes.
AGENT = """#!{python}
import os, shlex, sys
host, command = sys.argv[1], " ".join(sys.argv[2:])
rename = 'hostname mpi-%s && exec sh -c "$0"' % host.replace(".", "-")
os.execvp("ssh", ["ssh", *{ssh_options!r}, host,
                  "exec unshare --uts sh -c %s %s" % (shlex.quote(rename), shlex.quote(command))])
"""


def mpi_launcher(cluster, busy_poll=False, han=False, per_host=PER_HOST):
    """``mpirun`` onto the same hosts with the same key; TCP only on the bridge's subnet.

    Two settings keep Open MPI from collapsing on one machine's CPUs shared by two "hosts"
    (each flag below puts its default back, to see it):

    - the ranks yield while they wait (``mpi_yield_when_idle``, what ``--oversubscribe``
      sets, and what ``hora bench`` runs Open MPI with on one host).  Each host has as many
      slots as ranks, so Open MPI does not know that 4 ranks share 2 CPUs and by default
      spins: 4 B took 7-24 ms and 64 MiB 16-21 s here (``busy_poll``);
    - the collectives are coll/tuned's, not coll/han's (Open MPI 5's hierarchical ones, its
      default for a job on several hosts): with han, 1 MiB took 30-50 ms against tuned's
      1-10 ms, and 64 MiB swung between 0.17 and 3 s against tuned's 0.1-0.2 s (``han``).
    """
    hosts = _hosts(cluster, per_host)
    # the hosts' ssh logins do not have this Python's bin on PATH: --prefix finds prted
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(shutil.which("mpirun"))))
    agent = os.path.join(cluster.dir, "mpi_ssh_agent")
    with open(agent, "w") as f:
        f.write(AGENT.format(python=sys.executable, ssh_options=[
            "-i", cluster.key, "-o", "StrictHostKeyChecking=no", "-o",
            "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=10",
            "-o", "BatchMode=yes"]))
    os.chmod(agent, 0o755)
    # PRRTE's session directories in the cluster's directory, which goes with the cluster
    # (a killed job leaves its own behind)
    session = os.path.join(cluster.dir, "mpi-sessions")
    os.makedirs(session, exist_ok=True)
    subnet = f"{cluster.subnet}.0/24"
    return lambda n: ["mpirun", "-np", str(n), "--host", hosts, "--allow-run-as-root",
                      "--prefix", prefix, "--mca", "plm_rsh_agent", agent,
                      "--prtemca", "prte_tmpdir_base", session,
                      "-x", "PATH", "-x", "PYTHONPATH",
                      "--mca", "pml", "ob1", "--mca", "btl", "self,sm,tcp",
                      "--mca", "btl_tcp_if_include", subnet,
                      "--mca", "oob_tcp_if_include", subnet,
                      *([] if busy_poll else ["--mca", "mpi_yield_when_idle", "1"]),
                      *([] if han else ["--mca", "coll", "^han"])]


def remove_mpi_segments(cluster):
    """Remove the shared memory segments a killed Open MPI job left in /dev/shm (the host
    names the agent gives are this cluster's own: nobody else's segments match)."""
    name = f"mpi-{cluster.subnet.replace('.', '-')}-"
    for path in glob.glob(os.path.join("/dev/shm", f"sm_segment.{name}*")):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def run_launches(runners, plan, n):
    """``({system: {n: rows or {"error": text}}}, {system: [background CPU share]})``.

    Every system is launched ``plan["launches"]`` times, in turn, in reverse order every
    other time (as ``hora bench`` does); each launch gets its share of the size budget.
    Before each launch, half a second with nothing of ours running measures how much of
    the CPUs other work on the machine is using (the ranks run under the hosts' sshds, not
    under this process, so their own CPU time cannot be told apart during a launch)."""
    once = dict(plan, size_budget_s=plan["size_budget_s"] / plan["launches"])
    done = {s: [] for s in runners}
    errors, background = {}, {s: [] for s in runners}
    for k in range(plan["launches"]):
        for s in list(runners) if k % 2 == 0 else list(runners)[::-1]:
            if s in errors:
                continue
            _, share = others_share(time.sleep, 0.5)
            background[s].append(share)
            t0 = time.monotonic()
            try:
                done[s].append(jobs._run_launched(n, once, s, runners[s]))
                status = "ok"
            except Exception as e:  # noqa: BLE001 - a failed system is reported, not fatal
                errors[s] = f"{type(e).__name__}: {e}"
                status = f"FAILED: {errors[s]}"
            load = f", before it others used {share:.0%} of the CPUs" if share is not None else ""
            print(f"[bench] {s} N={n} ({k + 1}/{plan['launches']}): "
                  f"{time.monotonic() - t0:.1f} s{load}, {status}", file=sys.stderr, flush=True)
    return ({s: {n: {"error": errors[s]} if s in errors else jobs._summarize(done[s], n)}
             for s in runners}, background)


def _spread(row, value, fmt):
    """``median (min-max)`` of a row's latency (us) or busbw (GB/s) over its pooled rounds."""
    lo, hi = value(row, row["min_s"]), value(row, row["max_s"])
    return f"{fmt(value(row, row['time_s']))} ({fmt(min(lo, hi))}-{fmt(max(lo, hi))})"


def _latency_us(row, t):
    return t * 1e6


def _busbw(row, t):
    return row["busbw_gbps"] * row["time_s"] / t      # busbw is inversely proportional to t


def _fmt_us(us):
    return f"{us:.1f}" if us < 100 else f"{us:,.0f}"


def _fmt_gbps(x):
    return f"{x:.3f}" if x >= 0.01 else f"{x:.2g}"


def _rows(results, system):
    """A system's rows by size (the results hold one N)."""
    got = next(iter(results.get(system, {}).values()), None)
    return {r["bytes"]: r for r in got} if isinstance(got, list) else {}


def print_table(results, sizes, out=sys.stdout):
    """One row per size: each system's median and min-max latency and busbw, and
    t_MPI / t_hora (above 1 hora is faster; the busbw ratio hora/MPI), "?" on wide spreads
    and where the two ran at machine speeds a fifth apart (``report.speed_gap``)."""
    head = ["size"]
    for s in SYSTEMS:
        head += [f"{LABEL[s]} latency (us)", f"{LABEL[s]} busbw (GB/s)"]
    head.append("t_MPI / t_hora")
    print("| " + " | ".join(head) + " |", file=out)
    print("|" + "|".join("---:" for _ in head) + "|", file=out)
    hora, mpi = _rows(results, "hora"), _rows(results, "mpi")
    for size in sizes:
        cells = [report.fmt_size(size)]
        for rows in (hora, mpi):
            row = rows.get(size)
            cells += ([_spread(row, _latency_us, _fmt_us), _spread(row, _busbw, _fmt_gbps)]
                      if row else ["FAILED", "FAILED"])
        mine, theirs = hora.get(size), mpi.get(size)
        mark = "?" if report.doubtful(mine, theirs) else ""
        cells.append(f"{theirs['time_s'] / mine['time_s']:.2f}x{mark}" if mine and theirs
                     else "-")
        print("| " + " | ".join(cells) + " |", file=out)


def targets(results):
    """The issue's two targets: ``[{"name", "goal", "value", "met", "line"}]`` (value and
    met None where a system lacks the size)."""
    hora, mpi = _rows(results, "hora"), _rows(results, "mpi")
    found = []
    for nbytes, what, goal, text in (
            (BUSBW_BYTES, "busbw", BUSBW_GOAL, f">= {BUSBW_GOAL:g}x"),
            (LATENCY_BYTES, "latency", LATENCY_GOAL, f"<= {LATENCY_GOAL:g}x")):
        name = f"{report.fmt_size(nbytes)} {what} hora/MPI"
        mine, theirs = hora.get(nbytes), mpi.get(nbytes)
        if mine is None or theirs is None:
            found.append({"name": name, "goal": text, "value": None, "met": None,
                          "line": f"{name}: n/a (no {report.fmt_size(nbytes)} result for "
                                  f"{'hora' if mine is None else 'MPI'}) (target {text})"})
            continue
        if what == "busbw":
            value = mine["busbw_gbps"] / theirs["busbw_gbps"]
            met = value >= goal
            detail = f"hora {mine['busbw_gbps']:.3f} GB/s, MPI {theirs['busbw_gbps']:.3f} GB/s"
        else:
            value = mine["time_s"] / theirs["time_s"]
            met = value <= goal
            detail = (f"hora {_fmt_us(mine['latency_us'])} us, MPI "
                      f"{_fmt_us(theirs['latency_us'])} us")
        if report.speed_gap(mine, theirs):
            detail += "; " + report.speed_note(mine["probe_us"], theirs["probe_us"])
        found.append({"name": name, "goal": text, "value": value, "met": met,
                      "line": f"{name}: {value:.2f}x (target {text}; {detail})"
                              f"{'' if met else ' -- MISSED'}"})
    return found


def prepare():
    """Exit saying why when this machine cannot run the benchmark (namespaces, Open MPI);
    otherwise clear this shell's settings of hora, Horovod and Open MPI (the ranks' settings
    are the benchmark's) and let a kill (SIGTERM) unwind as Ctrl-C does, so that the
    cluster's exit removes the namespaces and sshds."""
    _, skipped = jobs.available(["mpi"])
    reason = netns.unavailable_reason() or skipped.get("mpi")
    if reason:
        raise SystemExit(f"cannot run: {reason}")
    for k in [k for k in os.environ if k.startswith(("HORA_", "HOROVOD_", "OMPI_", "PRTE_",
                                                     "PMIX_"))]:
        del os.environ[k]
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def require_sshd(cluster):
    """Exit unless the namespace hosts run real sshds (both launchers log in over ssh)."""
    if not cluster.use_sshd:
        raise SystemExit(f"needs real sshds on the namespace hosts: {cluster.no_sshd_reason}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,16K,1M,64M",
                        help="message sizes, e.g. '4,16K,1M,64M' (default)")
    parser.add_argument("--launches", type=int, default=3,
                        help="launches of each system; their rounds are pooled (default 3)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed rounds per size in each launch (default 3)")
    parser.add_argument("--round-s", type=float, default=0.2,
                        help="target seconds per timed round (default 0.2)")
    parser.add_argument("--size-budget-s", type=float, default=12.0,
                        help="seconds the timed rounds of one size may take over all launches "
                             "(default 12)")
    parser.add_argument("--job-timeout-s", type=float, default=240.0,
                        help="limit for one launch of one system (default 240)")
    parser.add_argument("--mpi-busy-poll", action="store_true",
                        help="leave Open MPI spinning while it waits (its default when it "
                             "does not know the hosts share the CPUs)")
    parser.add_argument("--mpi-han", action="store_true",
                        help="leave Open MPI's hierarchical collectives (coll/han) on")
    parser.add_argument("--per-host", type=int, default=PER_HOST,
                        help=f"ranks on each of the 2 hosts (default {PER_HOST})")
    parser.add_argument("--json", default=DEFAULT_JSON, help=f"(default {DEFAULT_JSON})")
    args = parser.parse_args()
    sizes = sorted({parse_size(s) for s in args.sizes.replace(",", " ").split()})
    if (not sizes or min(args.launches, args.rounds, args.per_host) < 1
            or args.round_s <= 0):
        parser.error("need at least one size, launch, round and rank a host, and a "
                     "positive --round-s")
    n = 2 * args.per_host
    prepare()
    plan = {"sizes": sizes, "launches": args.launches, "rounds": args.rounds,
            "round_s": args.round_s, "size_budget_s": args.size_budget_s,
            "job_timeout_s": args.job_timeout_s}
    started = time.monotonic()
    with netns.Cluster(["ok", "ok"]) as cluster:
        require_sshd(cluster)
        runners = {"hora": hora_launcher(cluster, args.job_timeout_s, args.per_host),
                   "mpi": mpi_launcher(cluster, args.mpi_busy_poll, args.mpi_han,
                                       args.per_host)}
        argv = {s: " ".join(launch(n)) for s, launch in runners.items()}
        for s in SYSTEMS:
            print(f"[bench] {s}: {argv[s]} {sys.executable} -m hora.bench.ranks {s} PLAN OUT",
                  file=sys.stderr, flush=True)
        try:
            results, background = run_launches(runners, plan, n)
        finally:
            remove_mpi_segments(cluster)
    print(f"\nallreduce float32 Sum, {n} ranks = 2 network-namespace hosts x {args.per_host} "
          f"(veth + bridge, sshd), {os.cpu_count()} CPUs; {args.launches} launches x "
          f"{args.rounds} rounds per system, median (min-max over the pooled rounds); "
          f"busbw = bytes/t * 2(N-1)/N, GB = 1e9 B\n")
    print_table(results, sizes)
    report.print_spread_warnings(results, list(SYSTEMS), [n], sizes)
    found = targets(results)
    print()
    for t in found:
        print(t["line"])
    busy = [x for s in SYSTEMS for x in background[s] if x is not None]
    if busy:
        print(f"\nother work on the machine used {min(busy):.0%}-{max(busy):.0%} of its "
              f"{os.cpu_count()} CPUs just before the launches")
    elapsed = time.monotonic() - started
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"benchmark": "allreduce_multihost", "dtype": "float32", "op": "Sum",
                   "np": n, "hosts": 2, "ranks_per_host": args.per_host, "argv": sys.argv[1:],
                   "plan": plan, "launchers": argv, "results": results,
                   "background_cpu_share": background, "targets": found, "elapsed_s": elapsed,
                   "machine": jobs.machine_info(list(SYSTEMS))}, f, indent=1, sort_keys=True)
    print(f"\n{elapsed:.0f} s in all; results written to {args.json}")
    return 1 if any(isinstance(r[n], dict) for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
