"""Choosing a data plane: HORA_BACKEND=gloo and mpi are refused, on every rank alike, with a
message that says what to install or how to launch."""
import sys

import pytest

from hora.core.dataplane import BACKENDS, check_backend
from hora.core.topology import Topology
from hora.errors import HoraError

ONE = Topology(0, 1, 0, 1, 0, 1, True, ("h",))
TWO = Topology(1, 2, 1, 2, 0, 1, True, ("h", "h"))


def test_gloo_and_mpi_are_backends():
    assert {"gloo", "mpi"} <= set(BACKENDS)
    with pytest.raises(HoraError, match="expected one of auto, tcp, shm, hierarchical, gloo, mpi"):
        check_backend("carrier-pigeon", TWO)


def test_gloo_without_torch_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)         # as if torch were not installed
    with pytest.raises(HoraError, match=r"HORA_BACKEND=gloo needs PyTorch: "
                                        r"pip install 'hora\[torch\]'"):
        check_backend("gloo", TWO, "hora")


def test_mpi_needs_mpirun():
    for source in ("hora", "torchrun", "slurm"):
        with pytest.raises(HoraError, match=f"needs a job started by mpirun .* from {source}"):
            check_backend("mpi", TWO, source)
    check_backend("mpi", ONE, "single")                     # alone: nothing to carry


def test_mpi_without_mpi4py_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(HoraError, match=r"pip install 'hora\[mpi\]'"):
        check_backend("mpi", TWO, "mpirun")


def test_nccl_without_a_cuda_device_says_so(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(HoraError, match=r"HORA_BACKEND=nccl needs a CUDA device: "
                                        r"torch.cuda.is_available\(\) is False"):
        check_backend("nccl", TWO, "hora")
    check_backend("nccl", ONE, "single")                    # alone: nothing to carry


def test_nccl_without_torch_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(HoraError, match=r"HORA_BACKEND=nccl needs PyTorch: "
                                        r"pip install 'hora\[torch\]'"):
        check_backend("nccl", TWO, "hora")


def test_waiters_on_shared_memory_sleep_at_once_where_many_ranks_share_each_cpu():
    from hora.config import Settings
    from hora.core.dataplane import CROWD_SPIN_MAX, spin_budget
    settings = Settings()

    def host(ranks, cpus):
        return Topology(0, ranks, 0, ranks, 0, 1, True, ("h",) * ranks, ranks, cpus)
    assert spin_budget(settings) == settings.spin_time_us / 1e6
    assert spin_budget(settings, host(2, 2)) == settings.spin_time_us / 1e6
    assert spin_budget(settings, host(2 * CROWD_SPIN_MAX, 2)) == settings.spin_time_us / 1e6
    assert spin_budget(settings, host(2 * CROWD_SPIN_MAX + 1, 2)) == 0.0
    assert host(64, 2).ranks_per_cpu == 32
