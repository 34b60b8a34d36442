"""init() under srun across two nodes, stood in for by the environment srun sets.

The nodes are 127.0.0.1 and 127.0.0.2 (both loopback), written as a bracketed node list;
each task's host name is its node's, as under srun.
"""
import socket
import subprocess
import sys

import pytest

from tests.helpers import launcher_free_env
from tests.multiproc.test_other_launchers import WORKER  # the same probe of init()


@pytest.mark.timeout(60)
def test_srun_two_nodes_two_tasks_each(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = launcher_free_env(tmp_path)
    nodes = ["127.0.0.1", "127.0.0.2"]
    procs = []
    for rank in range(4):
        node, local = divmod(rank, 2)
        env = dict(base, SLURM_PROCID=str(rank), SLURM_NTASKS="4", SLURM_LOCALID=str(local),
                   SLURM_NODEID=str(node), SLURM_STEP_NODELIST="127.0.0.[1-2]",
                   SLURM_STEP_TASKS_PER_NODE="2(x2)", SLURM_JOB_ID="31", SLURM_STEP_ID="0",
                   HORA_HOSTNAME=nodes[node], HORA_RENDEZVOUS_PORT=str(port),
                   RESULT_DIR=str(out))
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            text, _ = p.communicate(timeout=50)
            assert p.returncode == 0, text
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    rows = sorted(tuple(float(x) for x in f.read_text().split()) for f in out.iterdir())
    assert rows == [(r, 4, r % 2, 2, r // 2, 2, 10.0) for r in range(4)]
