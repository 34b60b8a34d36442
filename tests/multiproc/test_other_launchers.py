"""init() under the launchers people already have: torchrun and Slurm's srun.

torchrun itself is used when torch is installed; srun is stood in for by the environment it
sets (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_STEP_NODELIST, ...).
"""
import subprocess
import sys

import pytest

from tests.helpers import free_port_pair, launcher_free_env

WORKER = """
import os, numpy as np, hora
hora.init()
out = hora.allreduce(np.array([hora.rank() + 1.0]), op=hora.Sum, name="x")
row = (hora.rank(), hora.size(), hora.local_rank(), hora.local_size(), hora.cross_rank(),
       hora.cross_size(), float(out[0]))
with open(os.path.join(os.environ["RESULT_DIR"], str(hora.rank())), "w") as f:
    f.write(" ".join(map(str, row)))
hora.shutdown()
"""


def _results(directory):
    return sorted(tuple(float(x) for x in f.read_text().split()) for f in directory.iterdir())


def _clean_env(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    return launcher_free_env(tmp_path, RESULT_DIR=str(out))


@pytest.mark.timeout(90)
def test_under_torchrun(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    port = free_port_pair()
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "3",
         "--master-addr", "127.0.0.1", "--master-port", str(port), str(script)],
        capture_output=True, text=True, timeout=80, env=_clean_env(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert _results(tmp_path / "out") == [(r, 3, r, 3, 0, 1, 6.0) for r in range(3)]


@pytest.mark.timeout(60)
def test_under_slurm_srun_environment(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    port = free_port_pair()
    procs = []
    base = _clean_env(tmp_path)
    for r in range(3):
        env = dict(base, SLURM_PROCID=str(r), SLURM_NTASKS="3", SLURM_LOCALID=str(r),
                   SLURM_NTASKS_PER_NODE="3", SLURM_STEP_NODELIST="127.0.0.1",
                   SLURM_JOB_ID="77", SLURM_STEP_ID="0", HORA_RENDEZVOUS_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        for p in procs:
            out, err = p.communicate(timeout=45)
            assert p.returncode == 0, err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert _results(tmp_path / "out") == [(r, 3, r, 3, 0, 1, 6.0) for r in range(3)]
