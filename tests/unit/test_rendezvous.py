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


def test_a_will_is_put_when_its_connection_closes_unless_withdrawn(server):
    a, b, c = (RendezvousClient("127.0.0.1", server.port, server.secret) for _ in range(3))
    a.will("dead/a", "a left")
    a.will("dead/a2", "a left, last word")                  # replaces the first
    b.will("dead/b", "b left")
    b.will(None, None)                                      # withdrawn
    server.put("dead/c", "said first")
    c.will("dead/c", "c left")                              # a key's first value stays
    assert server.items("dead/") == {"dead/c": "said first"}
    for client in (b, c, a):
        client.close()
    deadline = time.monotonic() + 5
    while server._conns and time.monotonic() < deadline:    # every close served
        time.sleep(0.01)
    assert not server._conns
    assert server.items("dead/") == {"dead/a2": "a left, last word", "dead/c": "said first"}


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


@pytest.mark.timeout(30)
def test_hundreds_of_silent_connections_take_no_thread_and_delay_no_real_client():
    # today's design: one selector thread reads every pending handshake; before it, 128
    # handshake threads of 5 s each let 600 idle sockets hold a real client back ~20 s
    secret = new_secret()
    # the threads that start meanwhile, not a difference of counts: a thread of an earlier
    # test may end meanwhile (0 "server threads" in one full run)
    before = set(threading.enumerate())
    with RendezvousServer(secret, handshake_timeout=5.0) as s:
        silent = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(600)]
        try:
            time.sleep(0.5)             # the server has taken them all in by now
            new = [t.name for t in threading.enumerate() if t not in before]
            assert len(new) == 1, f"server threads for 600 silent connections: {new}"
            t = time.monotonic()
            client = RendezvousClient("127.0.0.1", s.port, secret, timeout=5)
            client.put("k", 1)
            took = time.monotonic() - t
            client.close()
            assert s.get("k") == 1
            assert took < 1.0, f"a real client waited {took:.2f} s behind silent ones"
        finally:
            for sock in silent:
                sock.close()


# -- a derivable key: the store serves what init() needs, and nothing else ------------------
def _text_only(rank, value):
    return None if isinstance(value, str) else "want text"


@pytest.fixture
def slot_server():
    from hora.rendezvous.policy import SlotPolicy
    secret = new_secret()
    policy = SlotPolicy(3, "init1/rank/", "init1/dead/", _text_only)
    with RendezvousServer(secret, handshake_timeout=1.0, policy=policy) as s:
        s.secret = secret
        yield s


def _client(server):
    return RendezvousClient("127.0.0.1", server.port, server.secret, timeout=5)


def test_with_a_derivable_key_a_client_must_claim_a_slot_before_anything(slot_server):
    from hora.errors import RendezvousError
    slot_server.put("init1/rank/2", "launcher")           # in-process access is not limited
    for request in (lambda c: c.get("init1/rank/2", timeout=0.1),
                    lambda c: c.wait_prefix("init1/rank/", 1, 0.0),
                    lambda c: c.put("other/key", "x"),
                    lambda c: c.delete("init1/rank/2"),
                    lambda c: c.put("init1/rank/3", "x"),            # no such rank
                    lambda c: c.put("init1/rank/01", "x"),           # not how a rank is written
                    lambda c: c.put("init1/rank/0", 5),              # not the schema
                    lambda c: c.put("init1/rank/2", "overwrite")):   # claimed already
        c = _client(slot_server)
        with pytest.raises(RendezvousError, match="refused"):
            request(c)
        c.close()
    assert slot_server.items() == {"init1/rank/2": "launcher"}
    assert slot_server.refused == 8


def test_a_slot_holder_reads_slots_and_notes_and_writes_one_note_once(slot_server):
    from hora.errors import RendezvousClosedError, RendezvousError
    a, b = _client(slot_server), _client(slot_server)
    a.put("init1/rank/0", "a")
    b.put("init1/rank/1", "b")
    ok, found = a.wait_prefix("init1/rank/", 2, timeout=1)
    assert ok and found == {"init1/rank/0": "a", "init1/rank/1": "b"}
    assert b.get("init1/rank/0", timeout=1) == "a"
    a.put("init1/dead/2", "rank 2 is gone")
    b.put("init1/dead/2", "a second opinion")              # acknowledged; the first stays
    assert slot_server.get("init1/dead/2") == "rank 2 is gone"
    with pytest.raises(RendezvousError, match="one rank slot"):
        a.put("init1/rank/2", "a second slot")
    with pytest.raises((RendezvousClosedError, RendezvousError)):
        a.get("init1/rank/0", timeout=0.1)                 # and a was dropped for it
    with pytest.raises(RendezvousError, match="not allowed"):
        b.delete("init1/rank/0")
    assert slot_server.get("init1/rank/0") == "a" and slot_server.get("init1/rank/2") is None
    a.close()
    b.close()


def test_a_slot_holder_leaves_a_note_as_its_will_and_nothing_else(slot_server):
    from hora.errors import RendezvousError
    a = _client(slot_server)
    a.put("init1/rank/0", "a")
    a.will("init1/dead/0", "rank 0 left")
    for claim, key, value in ((None, "init1/dead/1", "before a claim"),
                              ("init1/rank/1", "init1/rank/1", "a slot"),
                              ("init1/rank/2", "init1/dead/2", 5)):         # not text
        c = _client(slot_server)
        if claim:
            c.put(claim, "c")
        with pytest.raises(RendezvousError, match="refused"):
            c.will(key, value)
        c.close()
    assert slot_server.items("init1/dead/") == {}
    a.close()
    ok, value = slot_server.wait("init1/dead/0", 5)
    assert ok and value == "rank 0 left"
    assert slot_server.items("init1/dead/") == {"init1/dead/0": "rank 0 left"}


@pytest.mark.timeout(30)
def test_a_slot_claimed_twice_stops_the_store_naming_both_claimants(slot_server):
    # one of two claimants of a slot is not of the job: every client hears why, at once
    from hora.errors import RendezvousError
    told = []
    slot_server.on_conflict(told.append)
    first, waiting = _client(slot_server), _client(slot_server)
    first.put("init1/rank/2", "first")
    waiting.put("init1/rank/0", "waiting")
    heard = []

    def wait():
        try:
            waiting.wait_prefix("init1/rank/", 3, timeout=20)
        except RendezvousError as e:
            heard.append(str(e))
    thread = threading.Thread(target=wait)
    thread.start()
    second = _client(slot_server)
    holder, claimant = ("%s:%d" % c._sock.getsockname()[:2] for c in (first, second))
    with pytest.raises(RendezvousError, match="claimed twice") as refused:
        second.put("init1/rank/2", "second")
    thread.join(5)
    assert not thread.is_alive(), "the wait did not end when the store stopped"
    reason = (f"rank 2's slot 'init1/rank/2' was claimed twice: by {holder} first, then by "
              f"{claimant}")
    assert reason in str(refused.value) and "HORA_SECRET" in str(refused.value)
    assert len(heard) == 1 and "rendezvous stopped" in heard[0] and reason in heard[0]
    assert len(told) == 1 and told[0].startswith(reason) and slot_server.conflict == told[0]
    late = []
    slot_server.on_conflict(late.append)                    # told at once: it has happened
    assert late == told
    third = _client(slot_server)
    with pytest.raises(RendezvousError, match="claimed twice"):
        third.put("init1/rank/1", "a claim after the stop")
    assert slot_server.get("init1/rank/1") is None and slot_server.get("init1/rank/2") == "first"
    for c in (first, waiting, second, third):
        c.close()


def test_with_a_derivable_key_an_oversized_first_frame_is_refused_unread(slot_server):
    with socket.create_connection(("127.0.0.1", slot_server.port), timeout=5) as s:
        from hora.rendezvous.protocol import client_handshake
        client_handshake(s, slot_server.secret, b"rdzv")
        s.sendall(struct.pack("!I", 1 << 30) + b"\x80" * 100)
        assert _dropped(s)
    deadline = time.monotonic() + 5
    while slot_server.rejected < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert slot_server.rejected == 1


@pytest.mark.timeout(30)
def test_beyond_its_cap_the_handshake_gate_drops_the_oldest_pending_connection():
    from hora.rendezvous.gate import HandshakeGate
    from hora.rendezvous.protocol import client_handshake
    secret = new_secret()
    refused, admitted = [], []
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        gate = HandshakeGate(listener, secret, (b"rdzv",), timeout=10.0, max_pending=8,
                             on_refuse=lambda addr, why: refused.append(why))
        stop = threading.Event()

        def drive():
            while not stop.is_set():
                admitted.extend(gate.poll(0.05))
        driver = threading.Thread(target=drive, daemon=True)
        driver.start()
        idle = [socket.create_connection(listener.getsockname()) for _ in range(20)]
        try:
            with socket.create_connection(listener.getsockname(), timeout=5) as real:
                client_handshake(real, secret, b"rdzv")
            deadline = time.monotonic() + 5
            while not admitted and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(admitted) == 1
            assert len(refused) >= 12 and all("more than 8" in why for why in refused)
            assert _dropped(idle[0]) and gate.pending <= 8
        finally:
            stop.set()
            driver.join(5)
            gate.close()
            for s in idle + [a.sock for a in admitted]:
                s.close()
