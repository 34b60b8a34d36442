"""Connections opened on first use (hora.core.links through TcpTransport): the higher rank
dials, the lower one's thread answers; a peer that is gone is named, one that never dials
times out.  Real sockets, in one process."""
import socket
import threading
import time

import pytest

from hora.backends.tcp import TcpTransport
from hora.core.links import RANK, Links, ctrl_parents, eager_peers, ring_order
from hora.errors import CollectiveTimeoutError, HoraRankFailedError, TransportBrokenError
from hora.rendezvous import new_secret
from hora.rendezvous.protocol import client_handshake


def _listener():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


def _job(size, timeout=10.0):
    """``size`` transports with no connection yet, each with links to the others."""
    secret = new_secret()
    listeners = [_listener() for _ in range(size)]
    addrs = [l.getsockname() for l in listeners]

    def dialer(rank):
        def dial(peer, purpose, deadline):
            try:
                s = socket.create_connection(addrs[peer], timeout=2)
            except ConnectionRefusedError as e:
                raise HoraRankFailedError(f"rank {peer} refuses", rank=peer) from e
            client_handshake(s, secret, purpose)
            s.sendall(RANK.pack(rank))
            return s
        return dial
    return [TcpTransport(r, size, {}, timeout,
                         links=Links(listeners[r], secret, r, size, dialer(r)))
            for r in range(size)]


def test_the_ring_neighbours_are_the_first_connections():
    assert eager_peers(0, [0]) == []
    assert eager_peers(0, [0, 1]) == [1]
    assert eager_peers(0, [0, 1, 2, 3, 4]) == [1, 4]
    assert eager_peers(3, [0, 1, 2, 3, 4]) == [2, 4]
    assert eager_peers(0, [0, 1, 2, 4, 3]) == [1, 3]
    assert eager_peers(4, [0, 1, 2, 4, 3]) == [2, 3]


def test_the_jobs_ring_closes_through_the_last_hosts_leader():
    """Rank order, but on several hosts the last host is walked from its highest rank down,
    so that the ring's last link joins that host's leader (its lowest rank) to rank 0."""
    assert ring_order([]) == []
    assert ring_order(["a"] * 4) == [0, 1, 2, 3]
    assert ring_order(["a", "a", "b", "b", "b"]) == [0, 1, 4, 3, 2]
    assert ring_order(["a"] * 2 + ["b"] * 2 + ["c"] * 3) == [0, 1, 2, 3, 6, 5, 4]
    assert ring_order(["a", "b", "c"]) == [0, 1, 2]              # a rank a host
    # the last host's ranks are not all at the end (its leader is elsewhere): rank order
    assert ring_order(["a", "b", "a", "b"]) == [0, 1, 2, 3]
    # the closing link is a control pair: rank 0 and the last host's leader
    hosts = ["h%d" % (r // 8) for r in range(64)]
    order = ring_order(hosts)
    assert sorted(order) == list(range(64)) and order[-1] == 56
    assert ctrl_parents(hosts)[56] == 0
    assert eager_peers(0, order) == [1, 56]
    assert eager_peers(63, order) == [55, 62]


@pytest.mark.timeout(30)
def test_a_pair_connects_when_it_first_talks_whichever_side_comes_first():
    ts = _job(3)
    try:
        got = {}

        def talk(me, peer, delay):
            time.sleep(delay)
            buf = bytearray(5)
            ts[me].sendrecv(peer, memoryview(f"to {peer:02}".encode()), peer, memoryview(buf))
            got[me] = bytes(buf)
        # rank 0 waits for rank 2's dial; rank 2 dials late, then rank 1 and 2 talk
        threads = [threading.Thread(target=talk, args=(0, 2, 0.0)),
                   threading.Thread(target=talk, args=(2, 0, 0.3))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert got == {0: b"to 00", 2: b"to 02"}
        assert ts[0].peers == [2] and ts[2].peers == [0] and ts[1].peers == []
    finally:
        for t in ts:
            t.close()


@pytest.mark.timeout(30)
def test_a_peer_that_is_gone_is_named():
    ts = _job(2)
    ts[0].close()                       # rank 0's listener closes with it
    try:
        with pytest.raises(TransportBrokenError) as err:
            ts[1].send(0, memoryview(b"x"))
        assert err.value.rank == 0
    finally:
        ts[1].close()


@pytest.mark.timeout(30)
def test_a_peer_that_never_dials_times_out_naming_it():
    ts = _job(2, timeout=1.0)
    try:
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError, match="rank 1 did not connect"):
            ts[0].recv(1, memoryview(bytearray(4)))
        assert time.monotonic() - start < 5
    finally:
        for t in ts:
            t.close()
