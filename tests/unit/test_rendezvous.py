"""The authenticated key-value store, in process over real sockets."""
import os
import socket
import struct
import threading
import time

import pytest

from hora.errors import AuthenticationError, RendezvousTimeoutError
from hora.rendezvous import RendezvousClient, RendezvousServer, new_secret
from hora.rendezvous.protocol import MAGIC


def _dropped(sock):
    """True when the server closed the connection (FIN, or RST when our bytes were unread)."""
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


@pytest.fixture
def server():
    secret = new_secret()
    with RendezvousServer(secret, handshake_timeout=1.0) as s:
        s.secret = secret
        yield s


def test_put_get_and_waiting_for_keys(server):
    a = RendezvousClient("127.0.0.1", server.port, server.secret)
    b = RendezvousClient("127.0.0.1", server.port, server.secret)
    threading.Timer(0.2, a.put, args=("late", {"x": 1})).start()
    assert b.get("late", timeout=5) == {"x": 1}
    a.put("rank/0", 0)
    ok, found = b.wait_prefix("rank/", 2, timeout=0.3)
    assert not ok and found == {"rank/0": 0}
    with pytest.raises(RendezvousTimeoutError, match="'missing'"):
        b.get("missing", timeout=0.2)
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_wrong_key_garbage_and_silence_are_refused_and_the_server_keeps_serving(server):
    good = RendezvousClient("127.0.0.1", server.port, server.secret)
    good.put("k", "v")
    with pytest.raises(AuthenticationError):
        RendezvousClient("127.0.0.1", server.port, new_secret(), timeout=5)
    # a client that claims a huge frame before authenticating is never trusted
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(struct.pack("!I", 1 << 31) + b"\x80" * 64)
        s.settimeout(5)
        assert _dropped(s)                    # dropped without an answer
    # a client that opens correctly but answers the challenge wrongly
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(MAGIC + b"rdzv" + os.urandom(32))
        s.settimeout(5)
        s.recv(64)
        s.sendall(os.urandom(32))
        assert _dropped(s)
    # a client that says nothing is dropped after the handshake timeout
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(5)
        t = time.monotonic()
        assert _dropped(s)
        assert time.monotonic() - t < 4
    deadline = time.monotonic() + 5
    while server.rejected < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.rejected >= 4
    assert good.get("k", timeout=1) == "v"
    good.close()


def test_a_flood_of_silent_connections_is_held_to_a_few_handshake_threads(monkeypatch):
    import hora.rendezvous.server as server_mod
    monkeypatch.setattr(server_mod, "MAX_HANDSHAKES", 4)
    secret = new_secret()
    with RendezvousServer(secret, handshake_timeout=0.5) as s:
        silent = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(12)]
        try:
            time.sleep(0.2)
            busy = [t for t in threading.enumerate() if t.name == "hora-rendezvous-conn"]
            assert len(busy) <= 4, f"{len(busy)} handshake threads for 12 silent connections"
            # the silent ones time out four at a time; a real client is served after them
            client = RendezvousClient("127.0.0.1", s.port, secret)
            client.put("k", 1)
            client.close()
            assert s.get("k") == 1
            assert s.rejected >= 12
        finally:
            for sock in silent:
                sock.close()
