"""The collective suite again under Open MPI's mpirun with HORA_BACKEND=mpi: every buffer
above ring.SMALL goes through MPI (mpi4py), the rest through hora's direct TCP paths.  The
ranks are started by mpirun itself (tests.helpers.run_mpirun), N = 2 and 3 (CI time; at N = 1
hora.core.dataplane.make_plane makes no plane and check_backend asks nothing of mpirun, so it
is the default suite's N = 1).  The 2-rank job ends with the big buffer, the 3-rank job with
the check of which collectives MPI carried."""
import pytest

from tests.helpers import init_error, job_fixture, mpirun_unusable, run_mpirun, section

pytest.importorskip("mpi4py")
if mpirun_unusable():
    pytest.skip(mpirun_unusable(), allow_module_level=True)

from tests.multiproc import collective_job as suite  # noqa: E402
from tests.multiproc.test_collectives import *  # noqa: E402,F401,F403 - the same tests

_MPI = {"HORA_BACKEND": "mpi"}

job = job_fixture(suite.plane_worker, runner=run_mpirun, sizes=(2, 3), timeout_s=90,
                  env_for=lambda n: {**_MPI, **(suite.SMALL_FUSION_ENV if n == 3 else {})})


def test_mpi_carries_every_collective_above_small(job):
    for name, carried in section(job(3), "carried"):
        assert (name, carried) == ("MpiGroup", {"allreduce": 2, "allgather": 1, "broadcast": 1,
                                                "reducescatter": 1, "alltoall": 1})


def test_mpi_backend_outside_mpirun_is_a_clear_error():
    from tests.helpers import run_ranks
    for message in run_ranks(init_error, 2, timeout_s=30, env=_MPI, init=False):
        assert message is not None and message.startswith(
            "HORA_BACKEND=mpi needs a job started by mpirun (or `hora run --mpi`)"), message
