"""``hora run`` across hosts: network namespaces on a private bridge, each with a real sshd.

One cluster serves the whole module (tests/netns.py): two good hosts, one whose sshd is not
running, one where hora is not installed (hidden in its mount namespace), plus an address on
the bridge's subnet that nobody has.  The launcher runs in this namespace, at the bridge's
address, so a job can mix a local slot with remote ones.

Every test passes in both of the cluster's forms: with an sshd per host (the suite installs
openssh-server when it can), and in the no-sshd form (``HORA_TEST_NO_SSHD=1``, or no sshd to
be had), where ``ip netns exec`` enters the hosts and the start-up check meets its dead ends
with the real ssh client.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest

from tests import netns
from tests.helpers import alive_count, alive_with, survivors, until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOOD_A, GOOD_B, NO_SSHD, NO_HORA = range(4)


@pytest.fixture(scope="module")
def cluster():
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    with netns.Cluster(["ok", "ok", "no-sshd", "no-hora"]) as c:
        yield c


def _hora_run(cluster, hosts, *args, np_=None, timeout=60, cwd=None, env=None, ssh_args=None):
    np_ = np_ or sum(int(h.rsplit(":", 1)[1]) for h in hosts.split(","))
    ssh_args = cluster.ssh_args() if ssh_args is None else ssh_args
    argv = [sys.executable, "-m", "hora", "run", "-np", str(np_), "-H", hosts,
            *ssh_args, "--timeout", str(timeout - 10), *args]
    start = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=env, stdin=subprocess.DEVNULL)
    return done, time.monotonic() - start


WORKER = """
import os, sys, numpy as np, hora
from hora.rendezvous.netif import local_addresses
hora.init()
r, n = hora.rank(), hora.size()
x = np.arange(1000, dtype=np.float32) * (r + 1) + r
total = hora.allreduce(x, op=hora.Sum, name="x")
biggest = hora.allreduce(np.array([r * 7 % 5], dtype=np.int64), op=hora.Max, name="m")
rows = hora.allgather(np.full((r + 1, 2), r, dtype=np.int32), name="g")
w = hora.broadcast(np.arange(5.0) if r == 2 else np.zeros(5), root_rank=2, name="w")
np.save(os.path.join(sys.argv[1], f"{r}.npy"), np.concatenate(
    [total.astype(np.float64), biggest.astype(np.float64), rows.ravel(), w]))
addrs = sorted(a for _, a in local_addresses())
print("placed", r, hora.local_rank(), hora.cross_rank(), os.environ["HORA_HOSTNAME"],
      ",".join(addrs), os.getcwd())
hora.shutdown()
"""


@pytest.mark.timeout(60)
def test_allreduce_job_on_a_local_and_two_remote_hosts(cluster, tmp_path):
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    a, b = cluster.host(GOOD_A), cluster.host(GOOD_B)
    hosts = f"{cluster.launcher_address}:1,{a}:2,{b}:1"
    done, _ = _hora_run(cluster, hosts, sys.executable, str(script), str(tmp_path),
                        cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    # the launcher said where the job meets
    assert f"rendezvous at {cluster.launcher_address}:" in done.stderr, done.stderr
    # expected values, computed here with numpy
    n = 4
    xs = [np.arange(1000, dtype=np.float32) * (r + 1) + r for r in range(n)]
    expected = np.concatenate([
        np.sum(xs, axis=0).astype(np.float64), [max(r * 7 % 5 for r in range(n))],
        np.concatenate([np.full((r + 1, 2), r) for r in range(n)]).ravel(), np.arange(5.0)])
    for r in range(n):
        np.testing.assert_allclose(np.load(tmp_path / f"{r}.npy"), expected, rtol=1e-6)
    placed = {int(m[0]): m[1:] for m in re.findall(
        r"^\[\d\]<stdout>:placed (\d) (\d) (\d) (\S+) (\S+) (\S+)$", done.stdout, re.M)}
    assert sorted(placed) == [0, 1, 2, 3], done.stdout
    # host, local rank, cross rank; and each remote rank really ran inside its namespace
    ns_addr = {cluster.launcher_address: None, a: cluster.addresses[GOOD_A],
               b: cluster.addresses[GOOD_B]}
    want = {0: (cluster.launcher_address, "0", "0"), 1: (a, "0", "1"), 2: (a, "1", "0"),
            3: (b, "0", "2")}
    for r, (local_rank, cross_rank, host, addrs, cwd) in placed.items():
        assert (host, local_rank, cross_rank) == want[r]
        assert cwd == str(tmp_path)                               # same working directory
        if ns_addr[host] is not None:
            assert addrs.split(",") == sorted(["127.0.0.1", ns_addr[host]]), addrs


@pytest.mark.timeout(60)
def test_ranks_of_namespace_hosts_count_together_for_the_address_layout(cluster, tmp_path):
    # two namespace hosts are one kernel and its CPUs: under auto, their 4 ranks start
    # without address randomization when this machine has fewer CPUs; the remote check
    # reports the kernel, and the agent sets the personality
    from hora.core.topology import usable_cpus
    script = tmp_path / "layout.py"
    script.write_text("import os\n"
                      "fixed = int(open('/proc/self/personality').read(), 16) & 0x0040000\n"
                      "print('layout', os.environ['HORA_RANK'], int(bool(fixed)))\n")
    a, b = cluster.host(GOOD_A), cluster.host(GOOD_B)
    for flags, want in (((), 4 > usable_cpus()), (("--rank-aslr", "off"), True),
                        (("--rank-aslr", "on"), False)):
        done, _ = _hora_run(cluster, f"{a}:2,{b}:2", *flags, sys.executable, str(script),
                            cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        got = dict(re.findall(r"^\[\d\]<stdout>:layout (\d) (\d)$", done.stdout, re.M))
        assert got == {str(r): str(int(want)) for r in range(4)}, (flags, done.stdout)


@pytest.mark.timeout(150)
def test_pytorch_example_across_two_hosts(cluster, tmp_path):
    pytest.importorskip("torch")
    ckpt = tmp_path / "digits.pt"
    hosts = f"{cluster.host(GOOD_A)}:1,{cluster.host(GOOD_B)}:1"
    done, _ = _hora_run(cluster, hosts, "--network-interface", netns.IFACE, sys.executable,
                        os.path.join(ROOT, "examples", "pytorch_digits.py"), "--epochs", "2",
                        "--checkpoint", str(ckpt), timeout=140, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    epochs = re.findall(r"^\[0\]<stdout>:epoch +(\d+) ", done.stdout, re.M)
    assert epochs == ["1", "2"], done.stdout
    assert "data plane: interface hnet0" in done.stderr, done.stderr
    assert ckpt.exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which, reason", [
    ("unreachable", "unreachable"),
    (NO_SSHD, "ssh refused"),
    (NO_HORA, "hora is missing"),
], ids=["unreachable", "ssh-refused", "hora-missing"])
def test_startup_check_fails_fast_naming_host_and_reason(cluster, tmp_path, which, reason):
    if cluster.use_sshd:
        good, ssh_args = cluster.host(GOOD_A), cluster.ssh_args()
        bad = cluster.unreachable if which == "unreachable" else cluster.host(which)
    elif which == NO_HORA:
        # no sshd: ip netns exec enters the host with hora hidden, as the no-hora host's sshd
        # does; the good host is this one (the login hides hora on every remote host)
        good, bad = cluster.launcher_address, cluster.host(NO_HORA)
        ssh_args = cluster.ssh_args(hide_hora=True)
    else:
        # no sshd anywhere: the real ssh client meets the dead end (an address nobody has, a
        # port nobody listens on); the good host is this one
        if shutil.which("ssh") is None:
            pytest.skip("the no-sshd form checks ssh's failures with the ssh client: none here")
        good, ssh_args = cluster.launcher_address, []
        bad = cluster.unreachable if which == "unreachable" else cluster.addresses[which]
    hosts = f"{good}:1,{bad}:1"
    # a clean environment: the host without hora must not find it through PYTHONPATH
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done, elapsed = _hora_run(cluster, hosts, sys.executable, "-c", "print('ran')",
                              cwd=tmp_path, env=env, ssh_args=ssh_args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "ran" not in done.stdout                              # no rank started
    assert re.search(rf"^  {re.escape(bad)}: {reason}", done.stderr, re.M), done.stderr
    # the bad host alone is named: the good host passed
    assert re.findall(r"^  (\S+): ", done.stderr, re.M) == [bad], done.stderr
    assert good + ":" not in done.stderr
    assert elapsed < 12, elapsed




def _command_lines():
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    yield f.read()
            except OSError:
                pass


@pytest.mark.timeout(60)
def test_secret_stays_off_command_lines_and_no_remote_orphan_survives(cluster, tmp_path):
    marker = f"hora-test-{uuid.uuid4().hex}"
    script = tmp_path / "w.py"
    script.write_text(textwrap.dedent(f"""
        import os, subprocess, sys, time
        # a grandchild too: the whole remote process group must go
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", {marker!r}])
        with open(os.path.join({str(tmp_path)!r}, "ready." + os.environ["HORA_RANK"]), "w") as f:
            f.write(os.environ["HORA_SECRET"])
        time.sleep(60)
        """))
    hosts = f"{cluster.host(GOOD_A)}:1,{cluster.host(GOOD_B)}:1"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "hora", "run", "-np", "2", "-H", hosts, *cluster.ssh_args(),
         sys.executable, str(script), marker], cwd=tmp_path, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"ready.{r}").exists() for r in range(2)):
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "the remote ranks never became ready"
            time.sleep(0.05)
        time.sleep(0.2)
        secret = (tmp_path / "ready.0").read_text().encode()
        assert len(secret) == 64
        assert not [c for c in _command_lines() if secret in c]  # not in any `ps` line
        assert len(alive_count(marker, 5)) == 5      # the launcher, 2 ranks, 2 grandchildren
        launcher.kill()                                          # no chance to clean up
        launcher.communicate()
        # the agents' grace is 3 s, then ssh's teardown
        assert survivors(marker, 10) == [], "remote processes outlived the launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
        for pid in alive_with(marker):
            os.kill(pid, signal.SIGKILL)


CONNECTION = """
import os
# the agent's environment (the rank's is the job's alone): sshd's SSH_CONNECTION names the
# connection the session came by, as "client-address client-port server-address port"
with open(f"/proc/{os.getppid()}/environ") as f:
    agent = dict(v.split("=", 1) for v in f.read().split("\\0") if "=" in v)
print("conn", os.environ["HORA_RANK"], os.environ["HORA_HOSTNAME"],
      agent["SSH_CONNECTION"].split()[1])
"""


def _orphan_connections():
    """hora's shared ssh connections still running whose job has removed their sockets'
    folder (ssh names a shared connection "ssh: PATH [mux]")."""
    found = []
    for pid in alive_with("hora-ssh-"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().decode(errors="replace")
        except OSError:
            continue
        if "[mux]" in title and not os.path.isdir(os.path.dirname(title.split()[1])):
            found.append(title)
    return found


@pytest.mark.timeout(60)
def test_a_hosts_ranks_share_its_ssh_connections(cluster, tmp_path):
    if not cluster.use_sshd:
        pytest.skip("the no-sshd form enters the hosts with `ip netns exec`, not ssh")
    script = tmp_path / "conn.py"
    script.write_text(CONNECTION)
    a, b = cluster.host(GOOD_A), cluster.host(GOOD_B)
    # HORA_SSH_SESSIONS: the default (8) shares one connection a host, 2 one for each two
    # ranks of a host, 0 none
    for sessions, want in (("8", {a: 1, b: 1}), ("2", {a: 2, b: 1}), ("0", {a: 3, b: 2})):
        done, _ = _hora_run(cluster, f"{a}:3,{b}:2", sys.executable, str(script),
                            cwd=tmp_path, env={**os.environ, "HORA_SSH_SESSIONS": sessions})
        assert done.returncode == 0, done.stdout + done.stderr
        ports = {}
        for rank, host, port in re.findall(r"^\[\d\]<stdout>:conn (\d) (\S+) (\d+)$",
                                           done.stdout, re.M):
            ports.setdefault(host, set()).add(port)
        assert {h: len(p) for h, p in ports.items()} == want, (sessions, done.stdout)
    # the job ended its shared connections
    assert until(lambda: not _orphan_connections(), 5), _orphan_connections()


@pytest.mark.timeout(60)
def test_a_host_that_refuses_shared_sessions_still_runs_every_rank(cluster, tmp_path):
    """An sshd that allows fewer sessions a connection (MaxSessions) than HORA_SSH_SESSIONS:
    the sessions it refuses log in on connections of their own, and the job runs."""
    if not cluster.use_sshd:
        pytest.skip("the no-sshd form enters the hosts with `ip netns exec`, not ssh")
    script = tmp_path / "conn.py"
    # init waits for every rank: the 3 sessions of host a are open at once
    script.write_text(CONNECTION + "import hora, numpy\nhora.init()\n"
                      "hora.allreduce(numpy.ones(1), name='x')\n")
    a, b = cluster.host(GOOD_A), cluster.host(GOOD_B)
    done, _ = _hora_run(cluster, f"{a}:3,{b}:2", sys.executable, str(script), cwd=tmp_path,
                        ssh_args=["--ssh-port", str(netns.FEW_SESSIONS_PORT),
                                  "--ssh-identity-file", cluster.key])
    assert done.returncode == 0, done.stdout + done.stderr
    ports = {}
    for rank, host, port in re.findall(r"^\[\d\]<stdout>:conn (\d) (\S+) (\d+)$",
                                       done.stdout, re.M):
        ports.setdefault(host, set()).add(port)
    # a's first 2 sessions share one connection, its third has its own; b's 2 share one
    assert {h: len(p) for h, p in ports.items()} == {a: 2, b: 1}, done.stdout
    assert "Session open refused by peer" in done.stdout + done.stderr
    assert until(lambda: not _orphan_connections(), 5), _orphan_connections()


@pytest.mark.timeout(60)
def test_failing_remote_rank_fails_the_job_with_its_status(cluster, tmp_path):
    marker = f"hora-test-{uuid.uuid4().hex}"
    script = tmp_path / "w.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        if os.environ["HORA_RANK"] == "1":
            time.sleep(0.5)
            sys.exit(5)
        time.sleep(60)
        """))
    hosts = f"{cluster.host(GOOD_A)}:1,{cluster.host(GOOD_B)}:1"
    done, elapsed = _hora_run(cluster, hosts, sys.executable, str(script), marker,
                              cwd=tmp_path)
    assert done.returncode == 5, done.stderr
    assert "rank 1 (pid" in done.stderr and f"host {cluster.host(GOOD_B)}) exited with " \
        "code 5" in done.stderr, done.stderr
    assert elapsed < 15, elapsed
    assert alive_with(marker) == []


@pytest.mark.timeout(120)
def test_elastic_job_loses_a_worker_on_one_host_and_finishes_on_both(cluster, tmp_path):
    """An elastic job across two namespace hosts (2 slots each, from a discovery script):
    the worker that is rank 3 (on the second host) dies by SIGKILL; the three others,
    on both hosts, restore the last commit and finish at N=3 in the same processes, with
    the weights of one process training on the same global batches."""
    from tests import elastic_main
    a, b = cluster.host(GOOD_A), cluster.host(GOOD_B)
    hosts = tmp_path / "hosts"
    hosts.write_text(f"{a}:2\n{b}:2\n")
    out = tmp_path / "report.json"
    env = dict(os.environ, ELASTIC_OUT=str(out), ELASTIC_KILL="3:1:3",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    argv = [sys.executable, "-m", "hora", "run", "-np", "4", "--min-np", "2",
            "--host-discovery-script", f"cat {hosts}", *cluster.ssh_args(),
            "--timeout", "100", sys.executable, os.path.join(ROOT, "tests", "elastic_main.py")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=115, env=env,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"round 1 (removed): 3 worker(s): 0@{a}, 1@{a}, 2@{b}" in done.stderr, done.stderr
    import json
    report = json.loads(out.read_text())
    assert report["final_size"] == 3
    for seen in report["seen_epochs"]:
        assert sorted(seen) == list(range(elastic_main.SAMPLES))
    for got, want in zip(report["weights"], elastic_main.reference_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    for entries in report["pids"]:
        assert len({pid for _, _, pid in entries}) == 1
