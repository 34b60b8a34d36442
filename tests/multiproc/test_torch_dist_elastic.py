"""Elastic torchrun on backend "hora" (issue 64, item 3): ``torchrun --nnodes=1:2`` with two
agents (two "nodes" of one rank on this machine, torchrun's c10d rendezvous), one node
lost mid-training (its agent and its worker SIGKILLed): the survivor's worker names the
lost rank (hora's ``HoraRankFailedError``, where gloo waits out its timeout), its agent
restarts it in a job of one rank, and training resumes from rank 0's checkpoint.

The script's every step is an ``all_reduce`` of ``rank + 1``: rank 0 records each step's
result and the world size, so the check is the sum the ranks of that step make, computed
here (3 with two ranks, 1 alone), and that no step is lost or repeated across the restart.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import free_port_pair, launcher_free_env

pytest.importorskip("torch")

STEPS = 40

SCRIPT = """
import json, os, sys, time
import torch, torch.distributed as dist
import hora.torch  # noqa: F401 - registers the backend
dist.init_process_group("hora")
rank, size = dist.get_rank(), dist.get_world_size()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out = sys.argv[1]
ck = os.path.join(out, "checkpoint.json")
step = json.load(open(ck))["step"] if os.path.exists(ck) else 0
while step < {steps}:
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    step += 1
    if rank == 0:
        with open(os.path.join(out, "steps"), "a") as f:
            f.write(json.dumps([attempt, size, step, t.tolist()]) + "\\n")
        with open(ck + ".tmp", "w") as f:
            json.dump({{"step": step, "size": size}}, f)
        os.replace(ck + ".tmp", ck)
    time.sleep(0.05)
dist.destroy_process_group()
""".format(steps=STEPS)


def _tree(pid):
    """``pid`` and its descendants."""
    kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [pid] + [p for k in kids.split() for p in _tree(int(k))]


def _checkpoint(out):
    try:
        return json.loads((out / "checkpoint.json").read_text())
    except (OSError, ValueError):
        return None


@pytest.mark.timeout(90)
def test_a_lost_node_is_named_and_torchrun_restarts_the_survivor_alone(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    port = free_port_pair()
    env = launcher_free_env(tmp_path, HORA_SECRET="elastic-test", PYTHONUNBUFFERED="1")

    def node(i):
        # both nodes meet in the first round; a lost node is forgotten within seconds; the
        # first node hosts the rendezvous store (the one that goes must not hold it)
        conf = (f"is_host={int(i == 0)},last_call_timeout=3,keep_alive_interval=1,"
                f"keep_alive_max_attempt=2")
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
                "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hora-elastic",
                "--rdzv-conf", conf, "--max-restarts", "2", "--monitor-interval", "0.2",
                str(script), str(out)]
    logs = [open(tmp_path / f"node{i}.log", "w") for i in range(2)]
    nodes = [subprocess.Popen(node(i), env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True) for i, log in enumerate(logs)]
    try:
        deadline = time.monotonic() + 45
        while not ((_checkpoint(out) or {}).get("size") == 2
                   and _checkpoint(out)["step"] >= 5):
            assert time.monotonic() < deadline and nodes[0].poll() is None, (
                (tmp_path / "node0.log").read_text()[-3000:])
            time.sleep(0.1)
        for pid in _tree(nodes[1].pid):         # the second node goes: agent and worker
            os.kill(pid, signal.SIGKILL)
        assert nodes[0].wait(timeout=60) == 0, (tmp_path / "node0.log").read_text()[-4000:]
    finally:
        for node in nodes:
            for pid in _tree(node.pid) if node.poll() is None else ():
                os.kill(pid, signal.SIGKILL)
            node.wait()
        for log in logs:
            log.close()
    rows = [json.loads(line) for line in (out / "steps").read_text().splitlines()]
    # every step once, in order; each the sum of its ranks' rank + 1
    assert [step for _, _, step, _ in rows] == list(range(1, STEPS + 1))
    for attempt, size, step, value in rows:
        assert value == [size * (size + 1) / 2] * 2, (attempt, size, step, value)
    sizes = {attempt: size for attempt, size, _, _ in rows}
    assert sizes[0] == 2 and sizes[max(sizes)] == 1 and max(sizes) >= 1, sizes
    log = (tmp_path / "node0.log").read_text()
    assert "HoraRankFailedError" in log and "rank 1" in log, log[-3000:]
