"""Fuzzing the control plane of a live job: rank 0's listener while the job forms (where
every data and control connection is accepted), and the job's rendezvous server while the
ranks run collectives.  Every fuzzed connection is refused with a log line, and the job
completes with correct results.  HORA_FUZZ_EXAMPLES raises the example counts."""
import os
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import hora
from hora.errors import AuthenticationError, TransportBrokenError
from hora.rendezvous import new_secret
from tests.fuzzing import COUNTS, FUZZ, openings, probe
from tests.helpers import RawJob


def _late_dialer(flag):
    """Rank 1 registers, then waits for ``flag`` before it connects: meanwhile rank 0 is
    accepting connections, which is when its listener is exposed."""
    import hora.core.bootstrap as bootstrap
    if int(os.environ["HORA_RANK"]) == 1:
        real = bootstrap._dial

        def dial(*args, **kwargs):
            deadline = time.monotonic() + 50
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.01)
            return real(*args, **kwargs)
        bootstrap._dial = dial
    hora.init()
    out = hora.allreduce(np.arange(4.0), op=hora.Sum, name="after.fuzz")
    hora.shutdown()
    return out


def _wait_for(fn, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("timed out")


def fuzz_listener(addr, secret_for_wrong_key):
    """Unauthenticated openings and wrong-key handshakes at rank 0's listener."""
    @FUZZ
    @given(st.one_of(openings.map(lambda o: (o, None, None)),
                     st.sampled_from([b"data", b"ctrl"]).map(
                         lambda p: (("wrong job secret", b""), secret_for_wrong_key, p))))
    def one(case):
        (kind, payload), secret, purpose = case
        try:
            assert probe(addr, payload, secret=secret, purpose=purpose or b"rdzv"), kind
        except AuthenticationError:
            pass                        # the wrong-key handshake itself was refused
        except TransportBrokenError:
            pass                        # ... by closing the connection on us
        if secret is None and not payload:      # a port probe: dropped without a word
            kind = "a port probe (not logged)"
        COUNTS[f"rank 0 listener at init: {kind}"] += 1
    one()


@pytest.mark.timeout(120)
def test_fuzzing_rank0s_listener_during_init_leaves_the_job_unharmed(tmp_path):
    flag = tmp_path / "go"
    job = RawJob(_late_dialer, 2, tmp_path, args=(str(flag),),
                 env={"HORA_START_TIMEOUT": "90", "HORA_LOG_LEVEL": "WARNING"})
    try:
        entry = _wait_for(lambda: job.server.get("init1/rank/0"))
        _wait_for(lambda: job.server.get("init1/rank/1"))
        probe_key = "rank 0 listener at init: a port probe (not logged)"
        before = sum(COUNTS.values()) - COUNTS[probe_key]
        fuzz_listener((entry[0], entry[1]), new_secret())
        thrown = sum(COUNTS.values()) - COUNTS[probe_key] - before
        flag.write_text("go")
        results = job.results(timeout_s=60)
    finally:
        job.close()
    for res in results:
        assert res[0] == "ok", res
        np.testing.assert_array_equal(res[1], np.arange(4.0) * 2)
    refused = job.stderr(0).count("refused a connection")
    assert refused == thrown, f"{thrown} thrown, {refused} refusals logged"


def _train_until(stop):
    hora.init()
    total, steps = np.zeros(3), 0
    while True:
        more = os.path.exists(stop) if hora.rank() == 0 else False
        if hora.broadcast(np.array([more]), root_rank=0, name=f"stop.{steps}")[0]:
            break
        total += hora.allreduce(np.full(3, hora.rank() + 1.0), op=hora.Sum, name=f"s.{steps}")
        steps += 1
        if steps == 1 and hora.rank() == 0:
            Path(stop + ".running").touch()     # the job trains: the fuzzing may begin
    hora.shutdown()
    return steps, total


@pytest.mark.timeout(120)
def test_fuzzing_the_rendezvous_server_of_a_running_job(tmp_path):
    stop = tmp_path / "stop"
    job = RawJob(_train_until, 3, tmp_path, args=(str(stop),))
    try:
        _wait_for(lambda: Path(f"{stop}.running").exists())
        addr = ("127.0.0.1", job.server.port)
        before = job.server.rejected

        @FUZZ
        @given(openings)
        def one(opening):
            assert probe(addr, opening[1]), opening[0]
            COUNTS[f"rendezvous of a running job: {opening[0]}"] += 1
        one()
        thrown = job.server.rejected - before
        stop.write_text("stop")
        results = job.results(timeout_s=60)
    finally:
        job.close()
    assert thrown >= 1
    steps = results[0][1][0]
    assert steps > 0
    for res in results:
        assert res[0] == "ok", res
        assert res[1][0] == steps
        np.testing.assert_array_equal(res[1][1], np.full(3, 6.0 * steps))


def _timed_late_dialer(flag):
    """Ranks 1 and 2 connect once ``flag`` exists; every rank returns when init finished."""
    import hora.core.bootstrap as bootstrap
    if int(os.environ["HORA_RANK"]) > 0:
        real = bootstrap._dial

        def dial(*args, **kwargs):
            deadline = time.monotonic() + 50
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.01)
            return real(*args, **kwargs)
        bootstrap._dial = dial
    hora.init()
    done = time.time()
    out = hora.allreduce(np.arange(4.0), op=hora.Sum, name="after.silence")
    hora.shutdown()
    return done, out


@pytest.mark.timeout(60)
def test_silent_connections_to_rank0_do_not_delay_init(tmp_path):
    # connections that open and then say nothing hold no handshake slot of a real rank:
    # each would otherwise cost the handshake timeout (5 s) before the next is accepted
    import socket
    flag = tmp_path / "go"
    job = RawJob(_timed_late_dialer, 3, tmp_path, args=(str(flag),),
                 env={"HORA_START_TIMEOUT": "40"})
    silent = []
    try:
        entry = _wait_for(lambda: job.server.get("init1/rank/0"))
        _wait_for(lambda: job.server.get("init1/rank/2"))
        silent = [socket.create_connection((entry[0], entry[1])) for _ in range(4)]
        time.sleep(0.2)                 # rank 0 has accepted them and waits for their words
        go = time.time()
        flag.write_text("go")
        results = job.results(timeout_s=40)
    finally:
        for s in silent:
            s.close()
        job.close()
    for res in results:
        assert res[0] == "ok", res
        np.testing.assert_array_equal(res[1][1], np.arange(4.0) * 3)
    slowest = max(res[1][0] for res in results) - go
    assert slowest < 3.0, f"init took {slowest:.1f} s after the real ranks dialled"
