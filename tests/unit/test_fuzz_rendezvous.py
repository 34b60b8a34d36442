"""Fuzzing the rendezvous server with malformed, truncated, oversized and unauthenticated
frames (hypothesis; HORA_FUZZ_EXAMPLES=5000 for a long run): it refuses each with a log
line, keeps serving its real clients, and its memory stays bounded."""
import json
import logging
import pathlib
import resource
import subprocess
import sys
import threading

import pytest
from hypothesis import given

from hora.errors import AuthenticationError, TransportBrokenError
from hora.rendezvous import RendezvousClient, RendezvousServer, new_secret
from hora.rendezvous.protocol import client_handshake
from tests.fuzzing import COUNTS, FUZZ, after_auth, openings, probe, replay_bytes

_LOG = "hora.rendezvous.server"
_ROOT = pathlib.Path(__file__).resolve().parents[2]


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []
        self._lock = threading.Lock()

    def emit(self, record):
        with self._lock:
            self.lines.append(record.getMessage())


class _Target:
    """One server for a whole fuzz run, with a real client that must stay served."""

    def __init__(self, handshake_timeout=5.0):
        self.secret = new_secret()
        self.server = RendezvousServer(self.secret, handshake_timeout=handshake_timeout).start()
        self.addr = ("127.0.0.1", self.server.port)
        self.client = RendezvousClient(*self.addr, self.secret)
        self.client.put("job/step", 0)
        self.log = _Lines()
        logging.getLogger(_LOG).addHandler(self.log)

    def logged_since(self, n, text):
        """Whether a line logged after the first ``n`` says ``text`` (the logger is the
        module's, so a server left by an earlier test may log between ours)."""
        return any(text in line for line in self.log.lines[n:])

    def still_serving(self, step):
        self.client.put("job/step", step)
        return self.client.get("job/step", timeout=2) == step

    def close(self):
        logging.getLogger(_LOG).removeHandler(self.log)
        self.client.close()
        self.server.stop()


def fuzz_unauthenticated(target):
    """Throw unauthenticated openings; each is refused with a log line."""
    @FUZZ
    @given(openings)
    def one(opening):
        kind, payload = opening
        before, lines = target.server.rejected, len(target.log.lines)
        assert probe(target.addr, payload), f"{kind}: the server never dropped {payload[:40]!r}"
        if not payload:             # a port probe (nothing sent): dropped without a word
            assert target.server.rejected == before, kind
            COUNTS["rendezvous, unauthenticated: a port probe"] += 1
            return
        assert target.server.rejected == before + 1, kind
        assert target.logged_since(lines, "refused connection"), kind
        COUNTS[f"rendezvous, unauthenticated: {kind}"] += 1
    one()


def fuzz_authenticated_garbage(target):
    """An authenticated but broken client: malformed pickles, wrong shapes, lying lengths."""
    @FUZZ
    @given(after_auth)
    def one(frame):
        kind, payload = frame
        assert probe(target.addr, payload, secret=target.secret), kind
        COUNTS[f"rendezvous, authenticated: {kind}"] += 1
    one()


def _maxrss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def fuzz_and_measure():
    """Both fuzz runs on one server; what the test checks, as JSON (run in a fresh
    interpreter, whose peak memory is the fuzzing's and the server's alone: in the suite's
    process an earlier test's threads may still allocate)."""
    target = _Target()
    try:
        rss = _maxrss_mib()
        fuzz_unauthenticated(target)
        served = [target.still_serving(1)]
        fuzz_authenticated_garbage(target)
        served.append(target.still_serving(2))
        return json.dumps({"served": served, "grew_mib": _maxrss_mib() - rss,
                           "logged": any("malformed request" in line or "undecodable" in line
                                         for line in target.log.lines),
                           "counts": dict(COUNTS)})
    finally:
        target.close()


@pytest.mark.timeout(120)
def test_fuzzed_openings_are_refused_logged_and_the_server_keeps_serving():
    code = "from tests.unit import test_fuzz_rendezvous as t; print(t.fuzz_and_measure())"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=100, cwd=_ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["served"] == [True, True]
    # lengths of up to 4 GiB were announced, before and after authentication
    assert got["grew_mib"] < 64, "memory grew with the announced frame lengths"
    assert got["logged"]
    COUNTS.update(got["counts"])


@pytest.mark.timeout(60)
def test_a_replayed_authenticated_session_from_another_job_is_rejected():
    a, b = _Target(), _Target()
    try:
        captured = replay_bytes(a.addr, a.secret, ("put", "rank/0", "evil"))
        for target in (b, a):           # another job's server, and the same one again
            before, lines = target.server.rejected, len(target.log.lines)
            assert probe(target.addr, captured)
            assert target.server.rejected == before + 1
            assert target.logged_since(lines, "wrong job secret")
        assert b.server.get("rank/0") is None
        assert a.server.get("rank/0") == "evil"        # only the original session wrote it
        # and a client of job b does not trust a server of job a
        with pytest.raises(AuthenticationError):
            RendezvousClient(*a.addr, b.secret, timeout=5)
        COUNTS["replayed session from another job"] += 2
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(60)
def test_a_silent_client_is_dropped_and_does_not_block_others():
    target = _Target(handshake_timeout=2.0)     # waited out once: not the fuzz runs' 5 s
    try:
        import socket
        import time
        with socket.create_connection(target.addr) as silent:
            assert target.still_serving(3)          # served while the silent one waits
            silent.settimeout(10)
            t = time.monotonic()
            try:
                assert silent.recv(1) == b""
            except ConnectionResetError:
                pass
            assert time.monotonic() - t < 8
        # a correct handshake with the wrong purpose is refused too
        with socket.create_connection(target.addr, timeout=5) as s:
            with pytest.raises((AuthenticationError, TransportBrokenError)):
                client_handshake(s, target.secret, b"ctrl")
    finally:
        target.close()
