"""The collective suite again with HORA_BACKEND=gloo: every buffer above ring.SMALL in a
dtype gloo has goes through torch.distributed's gloo process group, the rest through the TCP
paths (needs torch: the ``test`` extra installs it).

N = 2 and 3 (CI time: every rank imports torch).  At N = 1 no plane is made
(hora.core.dataplane.make_plane), so it is the default suite's N = 1.  hora's gloo plane has
no branch on N: 2 is the smallest group, 3 the odd N (with tiny fusion buffers) and more
ranks than a 2-CPU machine has CPUs; 4 and 6 ranks ran the same calls on more ranks (the
default suite runs 7 through hora's own paths).  The 2-rank job ends with the big
buffer, the 3-rank job with the check of which collectives gloo carried."""
import pytest

pytest.importorskip("torch.distributed")

from tests.helpers import job_fixture, section  # noqa: E402
from tests.multiproc import collective_job as suite  # noqa: E402
from tests.multiproc.test_collectives import *  # noqa: E402,F401,F403 - the same tests

_GLOO = {"HORA_BACKEND": "gloo"}

job = job_fixture(suite.plane_worker, sizes=(2, 3), timeout_s=90,
                  env_for=lambda n: {**_GLOO, **(suite.SMALL_FUSION_ENV if n == 3 else {})})


def test_gloo_carries_every_collective_above_small(job):
    for name, carried in section(job(3), "carried"):
        # the uint16 sum is not among them: gloo has no uint16, the TCP ring served it
        assert (name, carried) == ("GlooGroup", {"allreduce": 1, "allgather": 1, "broadcast": 1,
                                                 "reducescatter": 1, "alltoall": 1})
