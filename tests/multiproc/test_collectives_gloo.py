"""The collective suite again with HORA_BACKEND=gloo: every buffer above ring.SMALL in a
dtype gloo has goes through torch.distributed's gloo process group, the rest through the TCP
paths (needs torch: the ``test`` extra installs it).  N = 1..4 and 6 (CI time; 6 with tiny
fusion buffers)."""
import pytest

pytest.importorskip("torch.distributed")

from tests.helpers import job_fixture, run_ranks  # noqa: E402
from tests.multiproc import collective_job as suite  # noqa: E402
from tests.multiproc.test_collectives import *  # noqa: E402,F401,F403 - the same tests

_GLOO = {"HORA_BACKEND": "gloo"}

job = job_fixture(suite.worker, sizes=(1, 2, 3, 4, 6),
                  env_for=lambda n: {**_GLOO, **(suite.SMALL_FUSION_ENV if n in (3, 6) else {})})


@pytest.mark.timeout(90)
def test_big_buffer_two_ranks():
    suite.check_big_buffer(run_ranks(suite.big_worker, 2, timeout_s=60, env=_GLOO))


def test_gloo_carries_every_collective_above_small():
    from tests.multiproc.planes import carried_by_plane
    for name, carried in run_ranks(carried_by_plane, 3, timeout_s=60, env=_GLOO):
        # the uint16 sum is not among them: gloo has no uint16, the TCP ring served it
        assert (name, carried) == ("GlooGroup", {"allreduce": 1, "allgather": 1, "broadcast": 1,
                                                 "reducescatter": 1, "alltoall": 1})
