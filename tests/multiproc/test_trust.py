"""Trust outside ``hora run``: a job whose key anyone can derive from public values.

Under torchrun (several hosts), SageMaker, or Slurm without a usable home directory, the job
key is a hash of public values (torchrun: run id, MASTER_ADDR, port).  Here real ranks run
under a torchrun-style environment with that key, and a separate *attacker* process that
knows only those public values computes the key, passes the handshake, and tries to get a
command run (a pickle that would create a marker file) and to store or read keys -- at the
rendezvous, and at the ranks' own listeners while the job forms.  Nothing runs, nothing is
stored, and the job finishes with correct results.  A second claim of a rank's slot (by the
rank itself, after an impostor) stops the job on every rank, naming the slot and both
claimants, whether the job is forming or already running.  Also: the rendezvous
binds loopback when MASTER_ADDR is 127.0.0.1 and every rank is on this host, the per-user
secret under Slurm (home directory in a temporary folder), and 600 idle connections to the
rendezvous port do not hold init back.
"""
import hashlib
import json
import os
import socket
import struct
import subprocess
import sys
import time

import pytest

from tests.helpers import free_port_pair, launcher_free_env

WORKER = r"""
import json, os, sys, time
import numpy as np
import hora
d = os.environ["TRUST_DIR"]
hold = os.environ.get("TRUST_HOLD_DIAL")
if hold:
    # this rank registers, then connects to its peers only once the file ``hold`` exists:
    # meanwhile the other ranks wait for it at their listeners, which is when they are exposed
    import hora.core.bootstrap as bootstrap
    real_dial = bootstrap._dial
    def dial(*args, **kwargs):
        deadline = time.monotonic() + 60
        while not os.path.exists(hold) and time.monotonic() < deadline:
            time.sleep(0.01)
        return real_dial(*args, **kwargs)
    bootstrap._dial = dial
t0 = time.monotonic()
hora.init()
init_s = time.monotonic() - t0
rank = hora.rank()
open(os.path.join(d, f"up{rank}"), "w").close()
go = os.path.join(d, "go")
deadline = time.monotonic() + 60
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.02)
s = hora.allreduce(np.array([rank + 1.0]), op=hora.Sum, name="after.attack")
gathered = hora.allgather_object({"rank": rank})
root = hora.broadcast_object({"from": "root", "v": [1, 2]}, root_rank=0)
hora.shutdown()
with open(os.path.join(d, f"out{rank}.json"), "w") as f:
    json.dump({"sum": float(s[0]), "gathered": gathered, "root": root, "init_s": init_s}, f)
"""

# The attacker: only public values (run id, address, port) and hora's public wire format.
ATTACKER = r"""
import hashlib, hmac, json, os, pickle, socket, struct, sys
addr, port, key_text, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
MAGIC, LEN = b"HORA\x01", struct.Struct("!I")

class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {marker}",))

def mac(key, *parts):
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()

def recv_exact(s, n):
    buf = b""
    while len(buf) < n:
        got = s.recv(n - len(buf))
        if not got:
            raise ConnectionError("closed")
        buf += got
    return buf

def handshake(s, purpose):
    key = bytes.fromhex(key_text)
    nc = os.urandom(32)
    s.sendall(MAGIC + purpose + nc)
    reply = recv_exact(s, 64)
    ns, server_mac = reply[:32], reply[32:]
    if server_mac != mac(key, b"S", purpose, nc, ns):
        return "server does not know the key"
    s.sendall(mac(key, b"C", purpose, ns, nc))
    try:
        return "passed" if recv_exact(s, 1) == b"\x06" else "refused"
    except (ConnectionError, OSError):
        return "refused"

def attempt(purpose, payload, after=b""):
    s = socket.create_connection((addr, port), timeout=5)
    local = "%s:%d" % s.getsockname()[:2]
    try:
        hs = handshake(s, purpose)
        if hs != "passed":
            return {"handshake": hs, "local": local}
        s.sendall(after + LEN.pack(len(payload)) + payload)
        try:
            n = LEN.unpack(recv_exact(s, 4))[0]
            reply = pickle.loads(recv_exact(s, n))   # the attacker's own process: fine
        except (ConnectionError, OSError) as e:
            reply = f"dropped: {e}"
        return {"handshake": hs, "reply": repr(reply), "local": local}
    except (ConnectionError, OSError) as e:
        return {"handshake": f"failed: {e}"}
    finally:
        s.close()

plan = json.loads(sys.argv[5])
out = []
for purpose, what, after in plan:
    payload = pickle.dumps(Evil() if what == "evil" else
                           tuple(tuple(x) if isinstance(x, list) else x for x in what))
    out.append(attempt(purpose.encode(), payload, bytes.fromhex(after)))
print(json.dumps(out))
"""


def _base_env(tmp_path):
    # a home of the test's own: where a per-user secret is made, it goes there
    return launcher_free_env(tmp_path, TRUST_DIR=str(tmp_path), HORA_START_TIMEOUT="40")


def _torchrun_env(base, rank, size, master_port, one_host):
    """What torchrun sets; ``one_host`` False: each rank as if alone on its own node."""
    return dict(base, RANK=str(rank), WORLD_SIZE=str(size), TORCHELASTIC_RUN_ID="none",
                LOCAL_RANK=str(rank if one_host else 0),
                LOCAL_WORLD_SIZE=str(size if one_host else 1), GROUP_RANK="0",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port),
                **({} if one_host else {"HORA_HOSTNAME": f"node{rank}"}))


def _torchrun_job(tmp_path):
    """A job of WORKER processes to start as torchrun would: the job, its base environment
    and the port its rendezvous meets at."""
    return _Job(tmp_path), _base_env(tmp_path), free_port_pair()


def _public_key(*identity):
    # what anyone can compute: the hash of the job's public identity
    return hashlib.sha256("|".join(map(str, identity)).encode()).hexdigest()


class _Job:
    def __init__(self, tmp_path, script=WORKER):
        self.dir = tmp_path
        self.script = tmp_path / "worker.py"
        self.script.write_text(script)
        self.procs = {}

    def start(self, rank, env):
        """Start the worker as ``rank`` (a name for its log: the rank, or another)."""
        log = open(self.dir / f"log{rank}", "wb")
        self.procs[rank] = subprocess.Popen([sys.executable, str(self.script)], env=env,
                                            stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        log.close()

    def wait_up(self, ranks, timeout=40):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all((self.dir / f"up{r}").exists() for r in ranks):
                return
            dead = [r for r, p in self.procs.items() if p.poll() is not None]
            assert not dead, f"ranks {dead} exited early:\n" + self.logs()
            time.sleep(0.02)
        raise AssertionError("the job did not form:\n" + self.logs())

    def finish(self, timeout=60):
        (self.dir / "go").write_text("go")
        deadline = time.monotonic() + timeout
        try:
            for r, p in self.procs.items():
                p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError("the job did not finish:\n" + self.logs()) from None
        finally:
            self.kill()
        for r, p in self.procs.items():
            assert p.returncode == 0, f"rank {r} failed:\n" + self.logs()
        return [json.loads((self.dir / f"out{r}.json").read_text())
                for r in sorted(self.procs)]

    def logs(self):
        return "\n".join(f"--- rank {r}\n" + (self.dir / f"log{r}").read_text(errors="replace")
                         for r in sorted(self.procs, key=str))

    def kill(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(10)


def _attack(tmp_path, port, key, plan, marker):
    run = subprocess.run([sys.executable, "-c", ATTACKER, "127.0.0.1", str(port), key,
                          str(marker), json.dumps(plan)],
                         capture_output=True, text=True, timeout=60, env=_base_env(tmp_path))
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def _check_results(results, size):
    for r, res in enumerate(results):
        assert res["sum"] == size * (size + 1) / 2
        assert res["gathered"] == [{"rank": i} for i in range(size)]
        assert res["root"] == {"from": "root", "v": [1, 2]}


def _listeners(pid):
    """The (address, port) of every listening TCP socket of process ``pid``."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    with open(f"/proc/{pid}/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:           # LISTEN
                ip, port = cols[1].split(":")
                found.append((socket.inet_ntoa(struct.pack("<I", int(ip, 16))), int(port, 16)))
    return found


@pytest.mark.timeout(120)
def test_an_outsider_with_the_derived_key_gets_nothing_run_or_stored(tmp_path):
    master_port = free_port_pair()
    port = master_port + 1
    marker = tmp_path / "pwned"
    base = _base_env(tmp_path)
    job = _Job(tmp_path)
    try:
        for r in range(3):
            job.start(r, _torchrun_env(base, r, 3, master_port, one_host=False))
        job.wait_up(range(3))
        key = _public_key("none", "127.0.0.1", port)
        entry = ["127.0.0.1", 1, "evil", 0, "ab" * 32, ""]
        plan = [
            ["rdzv", "evil", ""],                                    # (a) run a command
            ["rdzv", ["put", "evil/key", "x"], ""],                  # (b) store a new key
            ["rdzv", ["wait_prefix", "init1/rank/", 3, 0.0], ""],    # ... read the store
            ["rdzv", ["delete", "init1/rank/0"], ""],                # ... delete a rank
            ["rdzv", ["put", "init1/rank/3", tuple(entry)], ""],     # ... a rank that isn't
        ]
        out = _attack(tmp_path, port, key, plan, marker)
        # the derived key is computable: the handshake passes, and that is all it gets
        assert all(o["handshake"] == "passed" for o in out), out
        assert "error" in out[0]["reply"] or "dropped" in out[0]["reply"], out[0]
        for o in out[1:]:
            assert "error" in o["reply"], o
        assert "init1/rank/0" not in json.dumps(out[2])          # nothing of the store leaked
        results = job.finish()
    finally:
        job.kill()
    assert not marker.exists(), "the attacker's pickle ran a command in the job"
    _check_results(results, 3)
    log0 = (tmp_path / "log0").read_text()
    assert "derived from the job's public identity" in log0     # rank 0 said so, once
    assert log0.count("derived from the job's public identity") == 1
    assert "refused a request" in log0


@pytest.mark.timeout(120)
def test_an_outsider_cannot_join_the_mesh_while_the_job_forms(tmp_path):
    # rank 2 registers and holds back its connections: ranks 0 and 1 wait for it at their
    # listeners, where the attacker connects as rank 2 (control and data) with the derived key
    master_port = free_port_pair()
    port = master_port + 1
    marker = tmp_path / "pwned"
    base = _base_env(tmp_path)
    job = _Job(tmp_path)
    try:
        for r in range(3):
            env = _torchrun_env(base, r, 3, master_port, one_host=False)
            if r == 2:
                env["TRUST_HOLD_DIAL"] = str(tmp_path / "dial")
            job.start(r, env)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            targets = [(a, p) for r in range(2) for a, p in _listeners(job.procs[r].pid)
                       if p != port]
            if len(targets) == 2 and _listeners(job.procs[2].pid):
                break
            time.sleep(0.05)
        assert len(targets) == 2, targets
        time.sleep(0.5)                 # rank 2 has registered: 0 and 1 go to their listeners
        key = _public_key("none", "127.0.0.1", port)
        rank2 = struct.pack("!I", 2).hex()
        for addr, listen_port in targets:
            plan = [["ctrl", "evil", rank2], ["data", "evil", rank2]]
            run = subprocess.run([sys.executable, "-c", ATTACKER, addr, str(listen_port), key,
                                  str(marker), json.dumps(plan)], capture_output=True,
                                 text=True, timeout=60, env=base)
            assert run.returncode == 0, run.stderr
            out = json.loads(run.stdout)
            assert all(o["handshake"] != "passed" for o in out), (addr, listen_port, out)
            # it was answered (refused), not left waiting: the listener was live
            assert any("does not know" in o["handshake"] for o in out), out
        (tmp_path / "dial").write_text("go")
        job.wait_up(range(3))
        results = job.finish()
    finally:
        job.kill()
    assert not marker.exists()
    _check_results(results, 3)
    assert "refused a connection" in (tmp_path / "log0").read_text()


def _exits(job, names, within_s):
    """Wait for the processes ``names`` of ``job`` to exit: their exit codes, or a test
    failure (with the logs) if one runs past ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    try:
        return {n: job.procs[n].wait(max(0.1, deadline - time.monotonic())) for n in names}
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running after {within_s} s:\n{job.logs()}") from None


def _wait_for_port(port, job):
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, job.logs()
            time.sleep(0.05)


@pytest.mark.timeout(120)
def test_a_rank_slot_claimed_first_by_an_outsider_stops_every_rank(tmp_path):
    # with a derivable key the store is first come, first served: the real rank 2's claim,
    # second, is proof of an impostor, and rank 0 stops the job at once on every rank (the
    # start timeout, 40 s, is not what ends it), naming the slot and the claimant
    master_port = free_port_pair()
    port = master_port + 1
    base = _base_env(tmp_path)
    job = _Job(tmp_path)
    try:
        for r in range(2):
            job.start(r, _torchrun_env(base, r, 3, master_port, one_host=False))
        _wait_for_port(port, job)
        out = _attack(tmp_path, port, _public_key("none", "127.0.0.1", port),
                      [["rdzv", ["put", "init1/rank/2", ("127.0.0.1", 1, "x", 0, "ab" * 32, "")],
                        ""]], tmp_path / "pwned")
        assert out[0]["reply"] == "('ok',)", out
        (tmp_path / "go").write_text("go")
        job.start(2, _torchrun_env(base, 2, 3, master_port, one_host=False))
        codes = _exits(job, range(3), 10)
    finally:
        job.kill()
    assert all(code != 0 for code in codes.values()), codes
    for r in range(3):
        log = (tmp_path / f"log{r}").read_text()
        assert (f"rank 2's slot 'init1/rank/2' was claimed twice: by {out[0]['local']} first"
                in log and "HORA_SECRET" in log), (r, log)
        assert "did not connect within" not in log and "never arrived" not in log, (r, log)


@pytest.mark.timeout(120)
def test_an_impostor_that_joined_the_job_is_found_out_when_the_rank_comes(tmp_path):
    # a process with the job's public values runs hora as rank 2 before the real rank 2
    # starts: it takes the slot, reads the others' and joins the mesh.  When the real rank 2
    # claims its slot, rank 0 ends the running job on every rank with the reason
    job, base, master_port = _torchrun_job(tmp_path)
    try:
        for name, r in ((0, 0), (1, 1), ("impostor", 2)):  # the impostor before rank 2
            job.start(name, _torchrun_env(base, r, 3, master_port, one_host=False))
        job.wait_up(range(3))                   # up2: the impostor is in
        job.start(2, _torchrun_env(base, 2, 3, master_port, one_host=False))
        assert _exits(job, [2], 30)[2] != 0
        (tmp_path / "go").write_text("go")      # the next collective fails, at once
        codes = _exits(job, [0, 1, "impostor"], 10)
    finally:
        job.kill()
    assert all(code != 0 for code in codes.values()), (codes, job.logs())
    for name in (0, 1, 2):
        log = (tmp_path / f"log{name}").read_text()
        assert ("rank 2's slot 'init1/rank/2' was claimed twice: by 127.0.0.1:" in log
                and "HORA_SECRET" in log), (name, log)
    for name in (0, 1):
        assert "HoraInternalError" in (tmp_path / f"log{name}").read_text()


@pytest.mark.timeout(90)
def test_rendezvous_binds_loopback_for_a_one_host_job(tmp_path):
    job, base, master_port = _torchrun_job(tmp_path)
    try:
        for r in range(2):
            job.start(r, _torchrun_env(base, r, 2, master_port, one_host=True))
        job.wait_up(range(2))
        bound = [a for a, p in _listeners(job.procs[0].pid) if p == master_port + 1]
        results = job.finish()
    finally:
        job.kill()
    assert bound == ["127.0.0.1"], bound
    _check_results(results, 2)


def _slurm_env(base, rank, size, home, port):
    return dict(base, HOME=str(home), SLURM_PROCID=str(rank), SLURM_NTASKS=str(size),
                SLURM_LOCALID=str(rank), SLURM_NTASKS_PER_NODE=str(size),
                SLURM_STEP_NODELIST="127.0.0.1", SLURM_JOB_ID="4242", SLURM_STEP_ID="0",
                HORA_RENDEZVOUS_PORT=str(port))


@pytest.mark.timeout(120)
def test_slurm_ranks_share_a_per_user_secret_that_outsiders_cannot_derive(tmp_path):
    home = tmp_path / "slurm-home"
    home.mkdir()
    port = free_port_pair()
    marker = tmp_path / "pwned"
    base = _base_env(tmp_path)
    job = _Job(tmp_path)
    try:
        for r in range(2):
            job.start(r, _slurm_env(base, r, 2, home, port))
        job.wait_up(range(2))
        # the public values give the derived key; it is not this job's key any more
        out = _attack(tmp_path, port, _public_key("slurm", "4242.0"),
                      [["rdzv", "evil", ""]], marker)
        assert out[0]["handshake"] == "server does not know the key", out
        results = job.finish()
    finally:
        job.kill()
    assert not marker.exists()
    _check_results(results, 2)
    secret_dir, secret = home / ".hora", home / ".hora" / "secret"
    assert secret_dir.stat().st_mode & 0o777 == 0o700
    assert secret.stat().st_mode & 0o777 == 0o600
    assert "derived" not in job.logs()


@pytest.mark.timeout(120)
def test_idle_connections_to_the_rendezvous_do_not_delay_init(tmp_path):
    # rank 0 serves the rendezvous at the predictable MASTER_PORT + 1; rank 1 arrives after
    # 600 idle connections were opened to it (and once without), and times its init()
    def rank1_init_s(work, idle):
        work.mkdir()
        master_port = free_port_pair()
        port = master_port + 1
        base = _base_env(work)
        job = _Job(work)
        held = []
        try:
            job.start(0, _torchrun_env(base, 0, 2, master_port, one_host=False))
            deadline = time.monotonic() + 30
            while True:
                try:
                    held.append(socket.create_connection(("127.0.0.1", port), timeout=1))
                    break
                except OSError:
                    assert time.monotonic() < deadline, job.logs()
                    time.sleep(0.05)
            held += [socket.create_connection(("127.0.0.1", port)) for _ in range(idle - 1)]
            job.start(1, _torchrun_env(base, 1, 2, master_port, one_host=False))
            job.wait_up(range(2))
            results = job.finish()
        finally:
            for s in held:
                s.close()
            job.kill()
        _check_results(results, 2)
        return results[1]["init_s"]

    quiet = rank1_init_s(tmp_path / "quiet", 1)
    flooded = rank1_init_s(tmp_path / "flooded", 600)
    assert flooded - quiet < 1.0, f"init took {flooded:.2f} s with 600 idle connections, " \
                                  f"{quiet:.2f} s without"


OBJECT_WORKER = r"""
import json, os
import torch
import hora.torch as hvd

class Point:                        # an object that is not plain data
    def __init__(self, x):
        self.x = x

hvd.init()
rank, out = hvd.rank(), {}
try:
    got = hvd.broadcast_object(Point(7) if rank == 0 else None, root_rank=0)
    out["custom"] = ["ok", got.x]
except Exception as e:
    out["custom"] = [type(e).__name__, str(e)]
out["plain"] = hvd.broadcast_object({"epoch": 3, "files": ["a", "b"]} if rank == 0 else None)
# an optimizer state holds tensors: they travel as slots and broadcasts, the rest is data
torch.manual_seed(rank)
model = torch.nn.Linear(3, 2)
opt = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
hvd.broadcast_optimizer_state(opt, root_rank=0)
out["lr"] = opt.param_groups[0]["lr"]
hvd.shutdown()
with open(os.path.join(os.environ["TRUST_DIR"], f"out{rank}.json"), "w") as f:
    json.dump(out, f)
"""


def _run_object_job(tmp_path, extra_env):
    master_port = free_port_pair()
    base = dict(_base_env(tmp_path), **extra_env)
    job = _Job(tmp_path, OBJECT_WORKER)
    try:
        for r in range(2):
            job.start(r, _torchrun_env(base, r, 2, master_port, one_host=False))
        deadline = time.monotonic() + 60
        for r, p in job.procs.items():
            p.wait(max(0.1, deadline - time.monotonic()))
            assert p.returncode == 0, f"rank {r} failed:\n" + job.logs()
        return [json.loads((tmp_path / f"out{r}.json").read_text()) for r in range(2)]
    finally:
        job.kill()


@pytest.mark.timeout(120)
def test_with_a_derived_key_objects_travel_as_plain_data_only(tmp_path):
    root, other = _run_object_job(tmp_path, {})
    # the sender refuses before anything travels; the receiver fails with it, naming it
    assert root["custom"][0] == "TypeError" and "HORA_SECRET" in root["custom"][1], root
    assert other["custom"][0] == "CollectiveAbortedError" and "rank 0" in other["custom"][1]
    for res in (root, other):
        assert res["plain"] == {"epoch": 3, "files": ["a", "b"]}
        assert res["lr"] == 0.01            # rank 0's state, optimizer tensors included


@pytest.mark.timeout(120)
def test_with_a_real_secret_any_object_travels(tmp_path):
    for res in _run_object_job(tmp_path, {"HORA_SECRET": "our own secret, on every rank"}):
        assert res["custom"] == ["ok", 7] and res["lr"] == 0.01, res
