"""What a job costs as N grows, on one machine: hora beside Open MPI (mpi4py) and torch gloo
at N = 2 .. 64 ranks, oversubscribed, with tiny work per rank.

    python benchmarks/scale.py                              # N = 2 .. 64, 1 repeat
    python benchmarks/scale.py --np 2 4 8 --systems hora mpi --repeats 3 --json /tmp/s.json
    python benchmarks/scale.py --quick --systems hora       # N = 2, 4, few rounds (the test)
    python benchmarks/scale.py --np 8 16 32 64 --hosts-of 8 --json /tmp/s.json   # hosts of 8
    sudo python benchmarks/scale.py --np 8 16 32 64 --hosts-of 8 --netns   # namespace hosts

Each system's job is started by its own launcher (``hora run``, ``mpirun --oversubscribe``,
``torchrun``); every rank runs ``_scale_jobs.py``, which measures, in one job:

- start-up: from the launcher's start to the first completed allreduce on rank 0 (as
  ``startup.py`` times it: rank 0 prints the wall-clock time; gloo's ranks import torch,
  the others NumPy);
- the 4 B and the 1 MiB in-place allreduce: the median over rounds of the slowest rank's
  mean per round, as ``hora bench`` reports it;
- a training-like step, 100 float32 gradients of 1 KiB .. 64 KiB submitted asynchronously
  under stable names, then waited for: the slowest rank's wall time a step, and the CPU a
  step (``time.process_time``, every thread) of rank 0 and of rank 1;
- the sockets each rank holds after its first allreduce (/proc/self/fd), and how many of
  them are TCP connections to another rank of the job (their far end is one of that rank's
  sockets): rank 0's and the most of any other rank;
- hora's control messages a step (``hora.metrics()["control"]``), received and sent, on
  rank 0 and on a host's leader (``--hosts-of``), for that step and for the same gradients
  reduced as one grouped allreduce a step, beside which ``scale_model.py --compare`` puts its
  model.

``--hosts-of K`` places hora's ranks on hosts of K ranks that are all this machine (``hora run
-H 127.0.0.1:K,127.0.0.2:K,...``: each is a host to hora, with its own shared memory, its own
board and its leader; between them TCP over loopback), as a cluster of N / K machines would;
the peers run on one host as before.  With ``--netns`` the hosts are network namespaces on a
bridge, each with a real sshd and a host name of its own (``tests/netns.py``; root), and every
system runs across them: ``hora run`` and Open MPI's ``mpirun`` (``--map-by ppr:K:node``, ranks
yielding while they wait, as the hosts share this machine's CPUs) log in over ssh, and each
host runs one ``torchrun`` started over ssh, as a cluster's nodes do.

hora alone also has a killed-rank job (``tests.faults``' way: ranks started by
``tests.helpers.RawJob``, so that no launcher stops the survivors first): rank N/2 SIGKILLs
itself in a loop of 4 B allreduces, and every survivor records when it got its error and
which rank it named.  The peers were tried by hand at N = 4: Open MPI's ``mpirun`` ends the
whole job when a rank dies (its survivors see no error); gloo's survivors raise a
``RuntimeError`` within tens of milliseconds that names the dead peer's address and port,
not its rank, and ``torchrun`` then stops them.

Every job runs in a subprocess with a timeout (its process group killed at the end of it);
a system that cannot run here is skipped with the reason, one whose job fails is not run at
larger N.  Prints one table (a row per N; each measure hora / peers, and hora / peer), the
log-log slope of each measure against N (least squares over N = 8 .. 64, or every N measured
when fewer than two of those were), and with ``--plot`` / ``--json`` a figure and the numbers.
"""
import argparse
import compileall
import functools
import importlib.util
import json
import math
import os
import secrets
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _scale_jobs as jobs     # the benchmarks folder is sys.path[0]
from startup import _free_port, _once

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))      # tests.helpers, tests.faults (after any hora on PYTHONPATH)

SYSTEMS = ("hora", "mpi", "gloo")
SIZES = (4, 1 << 20)
PLANS = {   # each measure's warm-up, its timed rounds, and how long a round of calls or steps is
    "full": {"warm_s": 0.3, "rounds": 5, "round_s": 0.2, "step_round_s": 0.5, "budget_s": 20},
    "quick": {"warm_s": 0.05, "rounds": 2, "round_s": 0.02, "step_round_s": 0.05,
              "budget_s": 1},
}
KILL_AT = 50        # the killed rank dies before its 50th allreduce: the job runs by then
SLOPE_FROM = 8      # slopes are fitted from this N up: below it the machine is not crowded

# (key, heading, format) of each measure; the socket counts print with their TCP share
MEASURES = [("startup_s", "start-up s", "{:.2f}"), ("lat_4_us", "4 B µs", "{:.0f}"),
            ("lat_1m_us", "1 MiB µs", "{:.0f}"), ("step_ms", "step ms", "{:.1f}"),
            ("cpu0_ms", "CPU/step rank 0 ms", "{:.1f}"),
            ("cpuw_ms", "CPU/step rank 1 ms", "{:.1f}"),
            ("ctrl0_msgs", "control msgs/step rank 0 (in+out)", "{:.1f}"),
            ("sockets_rank0", "sockets rank 0 (TCP to peers)", "{:.0f}"),
            ("sockets_workers_max", "sockets, most of a worker (TCP to peers)", "{:.0f}")]
PEER_OF = {"sockets_rank0": "peer_tcp_rank0", "sockets_workers_max": "peer_tcp_workers_max"}


def _job_timeout_s(n):
    """A job's bound.  On 2 CPUs gloo's job at N = 64 took 280 s (start-up 56 s, a step
    69 s, run three times); the others took a minute or less."""
    return 120 + 8 * n


def _hosts(n, per_host, cluster=None):
    """``hora run``'s -H list: ``n`` ranks on hosts of ``per_host``: loopback names, or the
    namespace hosts of ``cluster``."""
    count = -(-n // per_host)
    name = cluster.host if cluster else (lambda h: f"127.0.0.{h + 1}")
    return ",".join(f"{name(h)}:{min(per_host, n - h * per_host)}" for h in range(count))


def _launchers(hosts_of=None, cluster=None):
    """``{system: argv(n, job_args)}`` of the systems that can run here, and ``{system: why
    not}``.  With ``cluster`` (namespace hosts of ``hosts_of``) every system runs across them:
    hora through ``hora run``'s ssh, Open MPI through its own (``plm_ssh_agent``), gloo as
    one ``torchrun`` a host started over ssh (as a cluster's nodes each run one)."""
    py, script = sys.executable, str(Path(__file__).with_name("_scale_jobs.py"))
    ssh = cluster.ssh_args() if cluster else []

    def where(n):
        return ["-H", _hosts(n, hosts_of, cluster), *ssh] if hosts_of else []
    argv, skipped = {"hora": lambda n, job: [py, "-m", "hora", "run", "-np", str(n),
                                             *where(n), py, script, *job]}, {}
    from hora.bench.jobs import _mpiexec    # Open MPI's flags for root and oversubscription
    mpiexec = _mpiexec()
    if importlib.util.find_spec("mpi4py") is None:
        skipped["mpi"] = "mpi4py is not importable"
    elif mpiexec is None:
        skipped["mpi"] = "no mpiexec on PATH that says its version"
    elif cluster:
        # hosts_of a host (its mapper would fill the first host's cores, then oversubscribe
        # it), waiting ranks yielding their CPU: the hosts share this machine's CPUs, which
        # each host's daemon cannot see (else a 4 B allreduce of 2 hosts of 8 takes 110 ms)
        # ssh's words but the host and command, which Open MPI appends (Open MPI 5 reads
        # PRTE_, 4 OMPI_)
        agent = " ".join(_ssh(cluster, "HOST", "COMMAND")[:-2])
        argv["mpi"] = lambda n, job: [
            "env", f"PRTE_MCA_plm_ssh_agent={agent}", f"OMPI_MCA_plm_rsh_agent={agent}",
            "OMPI_MCA_mpi_yield_when_idle=1", *mpiexec, "-np", str(n),
            "-H", _hosts(n, hosts_of, cluster), "--map-by", f"ppr:{hosts_of}:node", py, script,
            *job]
    else:
        argv["mpi"] = lambda n, job: [*mpiexec, "-np", str(n), py, script, *job]
    try:
        import torch.distributed as dist
        gloo = dist.is_available() and dist.is_gloo_available()
    except ImportError as e:
        skipped["gloo"], gloo = f"torch is not importable ({e})", False
    if gloo and cluster:
        argv["gloo"] = lambda n, job: _torchrun_hosts(n, hosts_of, cluster, [script, *job])
    elif gloo:
        argv["gloo"] = lambda n, job: [py, "-m", "torch.distributed.run", "--nproc-per-node",
                                       str(n), "--master-port", str(_free_port()), script,
                                       *job]
    elif "gloo" not in skipped:
        skipped["gloo"] = "this torch has no gloo backend"
    return argv, skipped


def _ssh(cluster, host, command):
    """The argv that runs ``command`` on ``cluster``'s ``host``: ``hora run``'s own ssh."""
    from hora.runner.remote import remote_argv
    return remote_argv(cluster.ssh_settings(), host, command)


def _torchrun_hosts(n, per_host, cluster, args):
    """A shell command that starts one ``torchrun`` on each namespace host over ssh, at the
    same time, and exits with the first failure among them."""
    from tests.netns import IFACE
    count = -(-n // per_host)
    port = 20000 + secrets.randbelow(20000)     # on host 0, a fresh namespace: nothing there
    starts = []
    for h in range(count):
        remote = (f"cd {shlex.quote(str(ROOT))} && OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME={IFACE} "
                  f"exec {shlex.quote(sys.executable)} -m torch.distributed.run --nnodes {count} "
                  f"--node-rank {h} --nproc-per-node {min(per_host, n - h * per_host)} "
                  f"--master-addr {cluster.host(0)} --master-port {port} "
                  + " ".join(shlex.quote(a) for a in args))
        starts.append(shlex.join(_ssh(cluster, cluster.host(h), remote)) + " & pids=\"$pids $!\"")
    return ["sh", "-c", "\n".join([*starts, "rc=0", "for p in $pids; do wait $p || rc=$?; done",
                                    "exit $rc"])]


def _env():
    """The launchers' environment: none of this process's job settings but
    HORA_CONTROL_FANOUT (to measure a tree of leaders with fewer hosts), one thread a rank."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HORA_", "OMPI_", "PMIX_", "HOROVOD_"))
           or k == "HORA_CONTROL_FANOUT"
           and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1"}


def _peer_tcp(records):
    """Per rank, how many of its TCP connections end at a socket of another rank."""
    owner = {local: r for r, rec in enumerate(records)
             for local, _ in rec["sockets"]["established"]}
    return [sum(owner.get(remote, r) != r for _, remote in rec["sockets"]["established"])
            for r, rec in enumerate(records)]


def _median_of_max(per_rank_rounds):
    """The median over rounds of the slowest rank's figure in that round."""
    return statistics.median(max(rnd) for rnd in zip(*per_rank_rounds))


def _measures(records, startup_s, hosts_of=None):
    """One job's measures from its ranks' records (in rank order)."""
    lat = {n: _median_of_max([rec["latency"][str(n)]["wall_s"] for rec in records])
           for n in SIZES}
    cpu = [statistics.median(rec["step"]["cpu_s"]) * 1e3 for rec in records]
    socks, peers = [rec["sockets"]["total"] for rec in records], _peer_tcp(records)
    return {"startup_s": startup_s, "lat_4_us": lat[4] * 1e6, "lat_1m_us": lat[1 << 20] * 1e6,
            "step_ms": _median_of_max([rec["step"]["wall_s"] for rec in records]) * 1e3,
            "cpu0_ms": cpu[0], "cpuw_ms": cpu[1],
            "sockets_rank0": socks[0], "sockets_workers_max": max(socks[1:]),
            "peer_tcp_rank0": peers[0], "peer_tcp_workers_max": max(peers[1:]),
            "steps_a_round": records[0]["step"]["calls"],
            **_control(records, hosts_of),
            "sockets_by_rank": [{k: v for k, v in rec["sockets"].items() if k != "established"}
                                for rec in records]}


def _control(records, hosts_of):
    """hora's control messages a step: rank 0's in + out (a measure), and for
    scale_model.py rank 0's and a leader's counts, and the requests a worker sends."""
    got = [rec["step"].get("control") for rec in records]
    if got[0] is None:
        return {}
    leader = hosts_of if hosts_of and len(records) > hosts_of else None
    worker = 1 if leader is None else leader + 1
    grouped = [rec.get("grouped") for rec in records]
    return {"ctrl0_msgs": got[0]["received"] + got[0]["sent"],
            "control": {"rank0": got[0], "leader": got[leader] if leader else None,
                        "batches": got[worker]["sent"] if worker < len(got) else None,
                        "grouped": {"rank0": grouped[0],
                                    "leader": grouped[leader] if leader else None}}}


def _run_job(system, n, argv, plan, tmp, hosts_of=None):
    """Launch one job of ``system`` at ``n`` ranks; returns its measures."""
    out = Path(tempfile.mkdtemp(prefix=f"{system}-{n}-", dir=tmp))
    (out / "plan.json").write_text(json.dumps(plan))
    cmd = argv(n, [system, str(out / "plan.json"), str(out)])
    startup_s, _ = _once(cmd, _env(), timeout_s=_job_timeout_s(n))
    missing = [r for r in range(n) if not (out / f"rank{r}.json").exists()]
    if missing:
        raise RuntimeError(f"{' '.join(cmd)}: no record from ranks {missing}")
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]
    return _measures(records, startup_s, hosts_of if system == "hora" else None)


def _run_kill(n, tmp):
    """hora's killed-rank job at ``n`` ranks: who each survivor named, and how long after
    the kill the slowest survivor had its error."""
    from tests.helpers import RawJob
    out = Path(tempfile.mkdtemp(prefix=f"kill-{n}-", dir=tmp))
    victim = n // 2
    job = RawJob(functools.partial(jobs.kill_job, victim, KILL_AT, str(out)), n, out)
    try:
        results = job.results(timeout_s=_job_timeout_s(n))
    except AssertionError as e:             # RawJob's word for ranks it had to kill
        raise RuntimeError(f"killed-rank job at N = {n}: {e}") from None
    fault = float((out / "fault").read_text()) if (out / "fault").exists() else None
    if fault is None:
        raise RuntimeError(f"killed-rank job at N = {n}: rank {victim} never died")
    seen = {}
    for r, res in enumerate(results):
        if r == victim:
            continue
        if res is None or res[0] != "ok":
            raise RuntimeError(f"killed-rank job: survivor {r} crashed: {res and res[1:3]}")
        seen[r] = res[1]
    late = [got["at"] - fault for got in seen.values() if got["at"] is not None]
    return {"victim": victim, "named": {r: got["named"] for r, got in seen.items()},
            "errors": sorted({got["error"] or "none" for got in seen.values()}),
            "all_named": all(got["named"] == victim for got in seen.values()),
            "detect_s": max(late) if len(late) == len(seen) else None,
            "detect_median_s": statistics.median(late) if late else None}


def _combine(runs):
    """The median of each numeric measure over a system's repeats at one N (and hora's
    control counts of every repeat, ``control_runs``: how far apart runs are)."""
    out = dict(runs[-1])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in runs)
    if "control" in out:
        out["control_runs"] = [r["control"] for r in runs]
    return out


def run(args):
    """Every job of the run; returns the JSON record (results, failures, slopes)."""
    if not args.netns:
        return _run(args, None)
    sys.path.insert(0, str(ROOT))
    from tests import netns
    reason = netns.unavailable_reason()
    if reason:
        raise SystemExit(f"--netns: cannot make namespace hosts here: {reason}")
    # each host with a name of its own: Open MPI tells hosts apart by name
    with netns.Cluster(["ok"] * -(-max(args.np) // args.hosts_of), hostnames=True) as cluster:
        if not cluster.use_sshd:
            raise SystemExit(f"--netns: no sshd for the hosts: {cluster.no_sshd_reason}")
        return _run(args, cluster)


def _run(args, cluster):
    plan = {**PLANS["quick" if args.quick else "full"], "sizes": list(SIZES)}
    launchers, skipped = _launchers(args.hosts_of, cluster)
    systems = [s for s in args.systems if s in launchers]
    skipped = {s: why for s, why in skipped.items() if s in args.systems}
    import hora     # byte-compiled first, as an installed wheel is (startup.py says why)
    compileall.compile_dir(os.path.dirname(hora.__file__), quiet=1)
    results = {s: {} for s in systems}
    failed = {}
    with tempfile.TemporaryDirectory(prefix="hora-scale-") as tmp:
        for n in args.np:
            runs = {s: [] for s in systems}
            for rep in range(args.repeats):
                for system in systems if rep % 2 == 0 else systems[::-1]:
                    if system in failed:
                        continue
                    try:
                        runs[system].append(_run_job(system, n, launchers[system], plan, tmp,
                                                     args.hosts_of))
                    except RuntimeError as e:
                        failed[system] = f"N = {n}: {e}"
                        print(f"{system} at N = {n} FAILED: {e}", file=sys.stderr)
            for system in systems:
                if runs[system]:
                    results[system][n] = _combine(runs[system])
            if "hora" in results and n in results["hora"]:
                try:
                    results["hora"][n]["kill"] = _run_kill(n, tmp)
                except RuntimeError as e:
                    failed["hora (killed rank)"] = str(e)
                    print(f"hora killed-rank job FAILED: {e}", file=sys.stderr)
            print(f"N = {n} done ({time.strftime('%H:%M:%S')})", file=sys.stderr, flush=True)
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(["python", "benchmarks/scale.py", *sys.argv[1:]]),
            "cpus": os.cpu_count(), "np": args.np, "repeats": args.repeats, "plan": plan,
            "hosts_of": args.hosts_of, "netns": args.netns,
            "systems": systems, "skipped": skipped, "failed": failed, "results": results,
            "slopes": _slopes(results)}


def _slope(points):
    """Least-squares slope of log(value) on log(N) over ``[(N, value)]``, values > 0."""
    pts = [(math.log(n), math.log(v)) for n, v in points if v and v > 0]
    if len(pts) < 2:
        return None
    mx, my = statistics.fmean(x for x, _ in pts), statistics.fmean(y for _, y in pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else None


def _slopes(results):
    """``{system: {measure: [slope, smallest N, largest N]}}``."""
    out = {}
    keys = [k for k, _, _ in MEASURES] + list(PEER_OF.values()) + ["kill_s"]
    for system, by_n in results.items():
        values = {k: [(n, m["kill"]["detect_s"] if k == "kill_s" else m.get(k))
                      for n, m in sorted(by_n.items()) if k != "kill_s" or "kill" in m]
                  for k in keys}
        out[system] = {}
        for k, pts in values.items():
            big = [p for p in pts if p[0] >= SLOPE_FROM and p[1]]
            use = big if len(big) >= 2 else [p for p in pts if p[1]]
            if _slope(use) is not None:
                out[system][k] = [_slope(use), use[0][0], use[-1][0]]
    return out


def _cell(key, fmt, values):
    if key in PEER_OF:
        return " / ".join("–" if v is None else f"{fmt.format(v[key])} ({v[PEER_OF[key]]:.0f})"
                          for v in values)
    return " / ".join("–" if v is None or v.get(key) is None else fmt.format(v[key])
                      for v in values)


def _kill_cell(kill):
    if not kill:
        return "–"
    if kill["detect_s"] is None:
        return f"NO (rank {kill['victim']}): a survivor saw no error"
    return (f"{'yes' if kill['all_named'] else 'NO'} (rank {kill['victim']}): "
            f"{kill['detect_s']:.2f}, {kill['detect_median_s']:.2f}")


def print_table(record):
    systems, results = record["systems"], record["results"]
    peers = [s for s in systems if s != "hora"]
    nps = sorted({n for by_n in results.values() for n in by_n})
    head = ["N"]
    for _, title, _ in MEASURES:
        head.append(f"{title}, {' / '.join(systems)}")
        if "hora" in systems and peers:
            head.append(f"{title}: hora / {', '.join(peers)}")
    if "hora" in systems:
        head.append("hora: killed rank named by every survivor, s (max, median)")
    print("| " + " | ".join(head) + " |\n|" + "---:|" * len(head))
    for n in nps:
        got = {s: results[s].get(n) for s in systems}
        row = [str(n)]
        for key, _, fmt in MEASURES:
            row.append(_cell(key, fmt, [got[s] for s in systems]))
            if "hora" in systems and peers:
                row.append(", ".join(f"{got['hora'][key] / got[p][key]:.2f}x"
                                     if got["hora"] and got[p] and got[p].get(key) else "–"
                                     for p in peers))
        if "hora" in systems:
            row.append(_kill_cell((got["hora"] or {}).get("kill")))
        print("| " + " | ".join(row) + " |")
    print(f"\nlog-log slope against N (least squares over N >= {SLOPE_FROM}, else every N):\n")
    print("| measure | " + " | ".join(systems) + " |\n|---|" + "---:|" * len(systems))
    names = {**{k: t for k, t, _ in MEASURES}, "peer_tcp_rank0": "TCP to peers, rank 0",
             "peer_tcp_workers_max": "TCP to peers, most of a worker",
             "kill_s": "killed rank named, s"}
    for key, title in names.items():
        cells = [(lambda s: f"{s[0]:.2f} (N {s[1]}..{s[2]})" if s else "–")(
            record["slopes"].get(system, {}).get(key)) for system in systems]
        if any(c != "–" for c in cells):
            print(f"| {title} | " + " | ".join(cells) + " |")
    for system, why in record["skipped"].items():
        print(f"\n{system}: skipped: {why}")
    for system, why in record["failed"].items():
        print(f"\n{system}: FAILED at {why[:300]}")


def plot(record, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = [k for k, _, _ in MEASURES] + ["kill_s"]
    titles = {**{k: t for k, t, _ in MEASURES}, "kill_s": "killed rank named, s (hora)"}
    fig, axes = plt.subplots(4, 3, figsize=(13, 14))
    for ax, key in zip(axes.flat, keys):
        for system, by_n in record["results"].items():
            pts = [(n, m["kill"]["detect_s"] if key == "kill_s" else m.get(key))
                   for n, m in sorted(by_n.items()) if key != "kill_s" or "kill" in m]
            pts = [(n, v) for n, v in pts if v]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=system)
        ax.set(xscale="log", yscale="log", title=titles[key], xlabel="N")
        ax.set_xticks(record["np"], [str(n) for n in record["np"]])
        ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
        ax.legend(fontsize=8)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    fig.suptitle(f"cost of a job against N on one {record['cpus']}-CPU machine, "
                 f"{record['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--repeats", type=int, default=1,
                        help="jobs of each system at each N, in alternating order (medians)")
    parser.add_argument("--quick", action="store_true", help="N = 2, 4 and few rounds")
    parser.add_argument("--hosts-of", type=int, metavar="K",
                        help="hora's ranks on hosts of K ranks, all this machine (see above)")
    parser.add_argument("--netns", action="store_true",
                        help="with --hosts-of: the hosts are network namespaces with sshd")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--plot", metavar="PATH")
    args = parser.parse_args()
    if args.quick:
        args.np = [2, 4]
    if args.netns and not args.hosts_of:
        parser.error("--netns needs --hosts-of")
    if min(args.np) < 2:
        parser.error("--np: every N must be at least 2 (a worker is measured beside rank 0)")
    record = run(args)
    print(f"\n{record['date']}, {record['cpus']} CPUs, {args.repeats} repeat(s): "
          f"{record['command']}\n")
    print_table(record)
    for path in filter(None, (args.json, args.plot)):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    if args.plot:
        plot(record, args.plot)
    return 1 if record["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
