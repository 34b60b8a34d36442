"""A rank's listener: each expected peer connects once, nobody else, nobody twice,
and idle connections delay no one.  Real sockets, the links' own acceptor."""
import queue
import socket
import struct
import threading
import time

import pytest

from hora.core.links import Acceptor as _Acceptor
from hora.errors import AuthenticationError, TransportBrokenError
from hora.rendezvous import new_secret
from hora.rendezvous.protocol import client_handshake

_RANK = struct.Struct("!I")


@pytest.fixture
def listener():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    yield sock
    sock.close()


class _Driver:
    """Runs the acceptor in a thread of its own (init runs it in the rank's main thread,
    which here dials)."""

    def __init__(self, acceptor):
        self.acceptor = acceptor
        self.got = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            got = self.acceptor.next(time.monotonic() + 0.05)
            if got is not None:
                self.got.put(got)

    def next(self, timeout):
        try:
            return self.got.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.acceptor.close()


def _dial(listener, secret, purpose, rank):
    s = socket.create_connection(listener.getsockname(), timeout=5)
    client_handshake(s, secret, purpose)
    s.sendall(_RANK.pack(rank))
    return s


def _closed(sock):
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.timeout(30)
def test_each_expected_peer_is_taken_once_and_cannot_be_replaced(listener, caplog):
    secret = new_secret()
    acceptor = _Acceptor(listener, secret, rank=0, size=3, ctrl_from=(1, 2))
    driver = _Driver(acceptor)
    kept = []
    try:
        kept.append(_dial(listener, secret, b"data", 1))
        purpose, peer, first = driver.next(5)
        assert (purpose, peer) == (b"data", 1)
        # the same rank again, a rank outside the job, this rank itself: refused, logged
        intruders = [_dial(listener, secret, b"data", r) for r in (1, 7, 0)]
        kept += intruders
        kept.append(_dial(listener, secret, b"ctrl", 2))
        purpose, peer, ctrl = driver.next(5)
        assert (purpose, peer) == (b"ctrl", 2)
        assert driver.next(0.3) is None
        assert all(_closed(s) for s in intruders)
        assert (acceptor.missing(b"data"), acceptor.missing(b"ctrl")) == ([2], [1])
        assert caplog.text.count("refused a connection") == 3
        assert "already connected" in caplog.text
        first.close()
        ctrl.close()
    finally:
        driver.close()
        for s in kept:
            s.close()


@pytest.mark.timeout(30)
def test_a_wrong_key_or_an_unexpected_purpose_is_refused(listener):
    secret = new_secret()
    driver = _Driver(_Acceptor(listener, secret, rank=1, size=3))  # data from rank 2 only
    try:
        for key, purpose in ((new_secret(), b"data"), (secret, b"ctrl"), (secret, b"rdzv")):
            with socket.create_connection(listener.getsockname(), timeout=5) as s:
                with pytest.raises((AuthenticationError, TransportBrokenError)):
                    client_handshake(s, key, purpose)
        assert driver.next(0.2) is None
    finally:
        driver.close()


@pytest.mark.timeout(30)
def test_hundreds_of_idle_connections_do_not_delay_a_real_peer(listener):
    secret = new_secret()
    driver = _Driver(_Acceptor(listener, secret, rank=0, size=3, ctrl_from=(1, 2)))
    idle = []
    try:
        idle = [socket.create_connection(listener.getsockname()) for _ in range(600)]
        assert driver.next(0.5) is None                 # it has taken them all in
        t = time.monotonic()
        real = _dial(listener, secret, b"data", 1)
        got = driver.next(5)
        took = time.monotonic() - t
        assert got is not None and got[:2] == (b"data", 1)
        assert took < 1.0, f"a real peer waited {took:.2f} s behind 600 idle connections"
        got[2].close()
        real.close()
    finally:
        driver.close()
        for s in idle:
            s.close()
