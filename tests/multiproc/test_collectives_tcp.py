"""The collective suite again with HORA_BACKEND=tcp: every buffer over the TCP ring and
direct paths (test_collectives.py runs the default, shared memory on one host).

N = 2 and 3 (CI time).  At N = 1 no transport is used (hora.core.dataplane.make_plane
makes no plane and the ring returns at once), so it is the default suite's N = 1.  The ring
and direct paths have no branch on N past 1: 2 is the pair, 3 the odd N (with tiny fusion
buffers) and more ranks than a 2-CPU machine has CPUs (4 ran the same paths); the default
suite runs the smaller matrix on 7 ranks.  The 2-rank job ends with the big buffer."""
from tests.helpers import job_fixture
from tests.multiproc import collective_job as suite
from tests.multiproc.test_collectives import *  # noqa: F401,F403 - the same tests

_TCP = {"HORA_BACKEND": "tcp"}

job = job_fixture(suite.worker, sizes=(2, 3), timeout_s=90,
                  env_for=lambda n: {**_TCP, **(suite.SMALL_FUSION_ENV if n == 3 else {})})
