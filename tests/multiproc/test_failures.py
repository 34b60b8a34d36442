"""Failure: a peer killed with SIGKILL, use before init(), a connection without the key."""
import os
import signal
import socket
import threading
import time

import numpy as np
import pytest

import hora
from hora.errors import AuthenticationError
from hora.rendezvous import RendezvousClient
from tests.helpers import RawJob, said, until, until_one_dies


def _die_or_wait(victim, when, big, kind="allreduce"):
    hora.init()
    rank = hora.rank()
    data = np.ones(big, np.float32)
    hora.allreduce(np.ones(1), name="warmup")
    if rank == victim:
        if when == "before":
            time.sleep(0.5)            # the others are already waiting in the allreduce
            t = time.time()
        else:
            def kill_soon():
                time.sleep(0.05)       # mid-transfer of the big allreduce
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Thread(target=kill_soon, daemon=True).start()
            t = time.time() + 0.05
        with open(os.environ["DEATH_FILE"], "w") as f:
            f.write(repr(t))
        if when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
    try:
        for i in range(50):
            if kind == "allgather":     # (on one host: read from the peers' buffers)
                hora.allgather(data, name=f"step.{i}")
            else:
                hora.allreduce(data, name=f"step.{i}")
        return ("finished",)
    except hora.HorovodInternalError as e:
        return (type(e).__name__, getattr(e, "rank", None), str(e), time.time())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("np_,victim,when,big,kind", [
    (3, 2, "before", 16, "allreduce"),          # survivors idle in a collective the victim
                                                # never joins
    (3, 1, "during", 8 << 20, "allreduce"),     # victim dies in a 32 MiB allreduce
    (3, 1, "during", 8 << 20, "allgather"),     # ... in allgathers of 32 MiB a rank
    (4, 0, "before", 16, "allreduce"),          # the coordinator itself dies
])
def test_survivors_name_the_dead_rank_within_seconds(tmp_path, np_, victim, when, big, kind):
    _, killed_at, survived = until_one_dies(_die_or_wait, np_, tmp_path, victim,
                                            args=(victim, when, big, kind), timeout_s=40)
    for r, got in survived.items():
        kind, rank, message, at = got
        assert kind == "HoraRankFailedError" and rank == victim, got
        assert f"rank {victim}" in message
        assert at - killed_at < 10.0, f"rank {r} took {at - killed_at:.1f} s to notice"


def _die_after_a_peer_connected():
    """Rank 1 dies in init() after rank 2 connected to it (and made all the connections it
    makes at init), before it dials rank 0: nobody's dial to it is refused, so only its will
    tells rank 0, which waits for its connection, that it is gone."""
    from hora.core import bootstrap
    rank = int(os.environ["HORA_RANK"])
    ready = os.path.join(os.path.dirname(os.environ["DEATH_FILE"]), "rank2-ready")
    if rank == 1:
        real = bootstrap._dial

        def dial_then_die(*a, **k):
            until(lambda: os.path.exists(ready), 20)
            with open(os.environ["DEATH_FILE"], "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **k)
        bootstrap._dial = dial_then_die
    if rank == 2:
        first = bootstrap._first_connections

        def connect_then_tell(*a, **k):
            got = first(*a, **k)
            open(ready, "w").close()
            return got
        bootstrap._first_connections = connect_then_tell
    try:
        hora.init()
        hora.allreduce(np.ones(1), name="never")
        return ("finished",)
    except hora.HorovodInternalError as e:
        return (type(e).__name__, getattr(e, "rank", None), str(e), time.time())


@pytest.mark.timeout(60)
def test_a_rank_that_dies_in_init_after_its_peers_connected_is_named_by_the_rank_waiting_for_it(
        tmp_path):
    _, killed_at, survived = until_one_dies(
        _die_after_a_peer_connected, 3, tmp_path, 1, timeout_s=45,
        env={"HORA_START_TIMEOUT": "30"})
    kind, rank, message, at = survived[0]
    assert (kind, rank) == ("HoraRankFailedError", 1), survived[0]
    assert "rank 1 registered" in message and "rendezvous store closed" in message
    assert at - killed_at < 5.0, f"rank 0 took {at - killed_at:.1f} s to notice"
    assert survived[2][1] == 1, survived[2]            # rank 2 names it too, in the allreduce


def test_collective_before_init_is_a_clear_error():
    assert not hora.is_initialized()
    with pytest.raises(hora.NotInitializedError, match="init"):
        hora.allreduce(np.ones(2))
    with pytest.raises(hora.HoraError):
        hora.rank()


def _slow_second_rank():
    if int(os.environ["HORA_RANK"]) == 1:
        time.sleep(1.5)
    hora.init()
    out = hora.allreduce(np.arange(4.0), op=hora.Sum, name="x")
    hora.shutdown()
    return out


@pytest.mark.timeout(60)
def test_connections_without_the_key_are_refused_and_the_job_is_unharmed(tmp_path):
    job = RawJob(_slow_second_rank, 2, tmp_path)
    # 1. the rendezvous server refuses a client with another job's key
    with pytest.raises(AuthenticationError):
        RendezvousClient("127.0.0.1", job.server.port, os.urandom(32).hex(), timeout=5)
    # 2. garbage and a half-open connection are dropped, the server keeps serving
    with socket.create_connection(("127.0.0.1", job.server.port)) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"\xff" * 100)
    # 3. rank 0's data listener (its address is in the store) refuses a wrong key too
    deadline = time.monotonic() + 10
    entry = None
    while entry is None and time.monotonic() < deadline:
        entry = job.server.get("init1/rank/0")
        time.sleep(0.02)
    assert entry is not None
    refused = []

    def bad_peer():
        from hora.rendezvous.protocol import client_handshake
        with socket.create_connection((entry[0], entry[1]), timeout=10) as s:
            try:
                client_handshake(s, os.urandom(32).hex(), b"data")
            except AuthenticationError:
                refused.append(True)

    t = threading.Thread(target=bad_peer)
    t.start()
    results = job.results(timeout_s=30)
    t.join(10)
    assert refused == [True]
    assert job.server.rejected >= 2
    for res in results:
        assert res[0] == "ok", res
        np.testing.assert_array_equal(res[1], np.arange(4.0) * 2)


def _late_rank(tmp):
    hora.init()
    if hora.rank() == 1:            # late until rank 0 has warned about it, at most 20 s
        until(lambda: "Missing ranks:\n1: [late.tensor]" in said(tmp, 0))
    out = hora.allreduce(np.ones(2), op=hora.Sum, name="late.tensor")
    hora.shutdown()
    return out


@pytest.mark.timeout(60)
def test_stall_warning_names_the_missing_rank_and_tensor(tmp_path):
    job = RawJob(_late_rank, 3, tmp_path, args=(str(tmp_path),),
                 env={"HORA_STALL_CHECK_TIME_SECONDS": "1"})
    results = job.results(timeout_s=30)
    for res in results:
        assert res[0] == "ok", res
        np.testing.assert_array_equal(res[1], [3.0, 3.0])
    err = job.stderr(0)
    assert "waiting for remainder of ranks" in err
    assert "Missing ranks:\n1: [late.tensor]" in err
    assert "[hora rank 0]" in err


def _never_submits(results):
    hora.init()
    if hora.rank() == 2:
        # "stuck in its input pipeline" until the others have failed (their result files,
        # tests.helpers.RawJob's, are written) or 30 s have passed
        until(lambda: all(os.path.exists(os.path.join(results, f"out{r}.pkl")) for r in (0, 1)),
              within_s=30)
        return "slept"
    try:
        hora.allreduce(np.ones(2), name="grad.w")
        return "no error"
    except hora.HoraInternalError as e:
        return str(e)


@pytest.mark.timeout(60)
def test_stall_shutdown_fails_every_rank_naming_the_tensor_and_ranks(tmp_path):
    job = RawJob(_never_submits, 3, tmp_path, args=(str(tmp_path),),
                 env={"HORA_STALL_CHECK_TIME_SECONDS": "1",
                      "HORA_STALL_SHUTDOWN_TIME_SECONDS": "2"})
    t = time.monotonic()
    results = job.results(timeout_s=40)
    for r in (0, 1):
        assert results[r][0] == "ok", results[r]
        assert "stalled" in results[r][1] and "2: [grad.w]" in results[r][1], results[r][1]
    assert time.monotonic() - t < 20
