"""The collective suite again with HORA_BACKEND=tcp: every buffer over the TCP ring and
direct paths (test_collectives.py runs the default, shared memory on one host)."""
import pytest

from tests.helpers import job_fixture, run_ranks
from tests.multiproc import collective_job as suite
from tests.multiproc.test_collectives import *  # noqa: F401,F403 - the same tests

_TCP = {"HORA_BACKEND": "tcp"}

job = job_fixture(suite.worker,
                  env_for=lambda n: {**_TCP, **(suite.SMALL_FUSION_ENV if n in (3, 6) else {})})


@pytest.mark.timeout(90)
def test_big_buffer_two_ranks():
    suite.check_big_buffer(run_ranks(suite.big_worker, 2, timeout_s=60, env=_TCP))
