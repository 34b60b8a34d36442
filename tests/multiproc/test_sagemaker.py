"""hora in a SageMaker training container, two "hosts" on this machine.

Each host is a fake /opt/ml tree (HORA_SAGEMAKER_ROOT) naming the same two hosts,
127.0.0.1 and 127.0.0.2 (both loopback), and a different current_host; each is started the
way SageMaker starts an image's entry point on every host.
"""
import os
import socket
import subprocess
import sys

import pytest

from tests.sagemaker_tree import make_tree

HOSTS = ["127.0.0.1", "127.0.0.2"]
FILES = [f"part-{i}" for i in range(7)]

WORKER = """
import os, sys, numpy as np, hora, hora.data
from hora.integrations.sagemaker import save_model
hora.init()
total = hora.allreduce(np.array([hora.rank() + 1.0]), op=hora.Sum, name="x")
mine = [os.path.basename(p) for p in hora.data.sagemaker_files("train")]
save_model(lambda path: path.write_text(str(hora.rank())), "model.txt")
row = [hora.rank(), hora.size(), hora.local_rank(), hora.local_size(), hora.cross_rank(),
       hora.cross_size(), float(total[0])]
with open(os.path.join(os.environ["RESULT_DIR"], str(hora.rank())), "w") as f:
    f.write(" ".join(map(str, row)) + "\\n" + ",".join(mine))
hora.shutdown()
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hosts(tmp_path, hyper):
    """One tree per host; returns [(root, env)]."""
    out = tmp_path / "out"
    out.mkdir()
    port = _free_port()
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("HORA_", "HOROVOD_", "OMPI_", "PMI_", "SLURM_", "SM_"))
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    hosts = []
    for host in HOSTS:
        root = make_tree(tmp_path / host, HOSTS, host, hyper, {"train": "File"})
        for name in FILES:
            (root / "input" / "data" / "train" / name).write_text(name)
        env = dict(base, HORA_SAGEMAKER_ROOT=str(root), HORA_RENDEZVOUS_PORT=str(port),
                   RESULT_DIR=str(out), TRAINING_JOB_NAME="hora-test",
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        hosts.append((root, env))
    return hosts


def _start_and_wait(argvs_envs, timeout_s):
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for argv, env in argvs_envs]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout_s)
            outputs.append(out)
            assert p.returncode == 0, out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return outputs


def _results(tmp_path):
    rows = {}
    for f in (tmp_path / "out").iterdir():
        head, files = f.read_text().split("\n")
        rows[int(f.name)] = (tuple(float(x) for x in head.split()), files.split(",") if files
                             else [])
    return [rows[r] for r in sorted(rows)]


@pytest.mark.timeout(90)
def test_hora_run_on_every_host_starts_processes_per_host(tmp_path):
    hosts = _hosts(tmp_path, {"sagemaker_mpi_num_of_processes_per_host": 2})
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    _start_and_wait([([sys.executable, "-m", "hora", "run", sys.executable, str(script)], env)
                     for _, env in hosts], timeout_s=80)
    results = _results(tmp_path)
    n = 4
    # ranks 0,1 on the first host, 2,3 on the second
    assert [row for row, _ in results] == [
        (r, n, r % 2, 2, r // 2, 2, n * (n + 1) / 2) for r in range(n)]
    # FullyReplicated channel: every rank its own files, all of them used once
    shares = [files for _, files in results]
    assert sorted(sum(shares, [])) == sorted(FILES)
    assert shares == [sorted(FILES)[r::n] for r in range(n)]
    # the model is written by rank 0 alone, on the first host
    assert (hosts[0][0] / "model" / "model.txt").read_text() == "0"
    assert not (hosts[1][0] / "model" / "model.txt").exists()


@pytest.mark.timeout(60)
def test_the_script_alone_is_one_rank_per_host(tmp_path):
    hosts = _hosts(tmp_path, {})
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    _start_and_wait([([sys.executable, str(script)], env) for _, env in hosts], timeout_s=50)
    results = _results(tmp_path)
    assert [row for row, _ in results] == [(r, 2, 0, 1, r, 2, 3.0) for r in range(2)]
    assert [files for _, files in results] == [sorted(FILES)[0::2], sorted(FILES)[1::2]]


@pytest.mark.timeout(30)
def test_hora_run_without_np_outside_sagemaker_asks_for_it(tmp_path):
    env = dict(os.environ, HORA_SAGEMAKER_ROOT=str(tmp_path))
    run = subprocess.run([sys.executable, "-m", "hora", "run", "true"], env=env,
                         capture_output=True, text=True, timeout=20)
    assert run.returncode == 2 and "-np" in run.stderr
