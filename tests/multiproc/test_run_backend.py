"""``hora run --backend NAME``: the workers get HORA_BACKEND=NAME, for every data plane that
``hora.core.dataplane.BACKENDS`` offers (read here, as the command line reads it)."""
import os
import subprocess
import sys
import textwrap

import pytest

from hora.core.dataplane import BACKENDS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# each rank: the backend it was given, what its settings say, and a checked allreduce
WORKER = textwrap.dedent("""
    import os
    import numpy as np
    import hora
    from hora.config import settings_from_env
    hora.init()
    got = hora.allreduce(np.arange(300_000, dtype=np.float64) * (hora.rank() + 1),
                         op=hora.Sum, name="x")
    assert np.array_equal(got, np.arange(300_000, dtype=np.float64) * 3), "wrong sum"
    print("backend", hora.rank(), os.environ.get("HORA_BACKEND"), settings_from_env().backend)
    hora.shutdown()
""")


def _hora(*args, env=None):
    return subprocess.run([sys.executable, "-m", "hora", *args], capture_output=True,
                          text=True, timeout=90, cwd=ROOT, env=env)


@pytest.mark.parametrize("name", ["tcp", "shm"])
def test_backend_reaches_every_worker(name):
    env = {k: v for k, v in os.environ.items() if k not in ("HORA_BACKEND", "HOROVOD_BACKEND")}
    env["HORA_BACKEND"] = "bogus-from-the-caller"       # the flag wins over the caller's
    proc = _hora("run", "-np", "2", "--backend", name, sys.executable, "-c", WORKER, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(ln.split("backend ", 1)[1] for ln in proc.stdout.splitlines()
                   if "backend " in ln)
    assert lines == [f"0 {name} {name}", f"1 {name} {name}"]


def test_without_the_flag_the_environment_decides():
    env = {**os.environ, "HORA_BACKEND": "tcp"}
    proc = _hora("run", "-np", "2", sys.executable, "-c", WORKER, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("tcp tcp") == 2


def test_choices_are_the_data_planes_and_others_are_refused():
    help_text = _hora("run", "--help").stdout
    assert "--backend {" + ",".join(BACKENDS) + "}" in help_text
    proc = _hora("run", "-np", "2", "--backend", "carrier-pigeon", "true")
    assert proc.returncode == 2
    assert "invalid choice: 'carrier-pigeon'" in proc.stderr
    assert all(repr(b) in proc.stderr for b in BACKENDS)


def test_nccl_without_a_gpu_fails_at_init_saying_why():
    pytest.importorskip("torch")
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    proc = _hora("run", "-np", "2", "--backend", "nccl", sys.executable, "-c", WORKER)
    assert proc.returncode != 0
    assert "HORA_BACKEND=nccl needs a CUDA device" in proc.stdout + proc.stderr
