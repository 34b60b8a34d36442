"""A rank's data connections: its ring neighbours at init, any other peer when first needed.

A job of N ranks does not form a full mesh (N·(N−1)/2 connections; near 500 ranks a rank
would run out of the default 1,024 file descriptors).  At init each rank connects to its two
neighbours on the job's ring (:func:`ring_order`), which every collective's ring uses; any
other pair connects the first time one of its collectives needs it (a process set's ring,
the leaders of a multi-host job, an alltoall).  Both ranks of a pair always need it together
(a collective runs on all its members), so the rule that makes each connection once is
fixed: the higher rank dials, the lower one accepts.  The accepting side does not wait in
its main thread: a thread of this module answers every handshake as it arrives
(:class:`Links`), for the life of the job, so a dial completes as soon as the peer's process
is scheduled, whatever its main thread does.

In a job on several hosts a control connection (:func:`ctrl_parents`) carries the pair's
data too (:mod:`hora.backends.mux`): ring neighbours that are also a rank and its control
parent dial once, for both; a pair with a control connection that later needs data uses it.
So a rank holds one connection per peer it talks to, and rank 0 one per leader and per rank
of its host (the job's ring closes through a leader to it).  On one host the pairs keep two
(``share`` off): the framing costs each control message about a microsecond, which the
small collectives of a one-host job would pay (7 to 21% of a small allreduce of 2 or 4
ranks over TCP), for no connection that grows with hosts.

Every connection opens with the HMAC handshake under the job's *mesh key* (see
:mod:`hora.core.bootstrap`) and then names its rank; a connection that fails the handshake,
or claims a rank that is not expected or already connected, is logged and dropped.

Layer: core.
"""
import collections
import logging
import socket
import struct
import threading
import time

from ..config import Settings
from ..errors import (CollectiveTimeoutError, HoraRankFailedError, RendezvousTimeoutError,
                      TransportBrokenError)
from ..backends.mux import Shared
from ..rendezvous.gate import HandshakeGate

__all__ = ["Links", "RANK", "eager_peers", "ring_order", "ctrl_parent", "ctrl_parents",
           "ctrl_children", "ctrl_routes", "ctrl_below", "CTRL_FANOUT", "GROUP"]

log = logging.getLogger(__name__)

RANK = struct.Struct("!I")      # what a dialing rank sends after its handshake: its rank
_HANDSHAKE_S = 5.0       # an accepted connection must authenticate (and name its rank) by then
_SLICE_S = 0.5           # how long the acceptor thread sleeps when nothing arrives
CTRL_FANOUT = Settings.control_fanout     # leaders below a leader (HORA_CONTROL_FANOUT)
GROUP = 8       # ranks a leader gathers on one host of many (a host of 8 GPUs' worth): its
#                 connections stay within what a worker holds across hosts
# what a connection of each purpose stands for: a control connection carries its pair's data
# when they need it later; one dialed for both carries their ring's data from the start
_CLAIMS = {b"data": (b"data",), b"ctrl": (b"ctrl", b"both"),
           b"both": (b"ctrl", b"both", b"data")}


def ring_order(hosts):
    """The job's ring, from every rank's host name: the ranks in rank order, except that in
    a job on several hosts whose last host's ranks come last (as ``hora run`` places them)
    the ring goes through that host from its highest rank down, so that it closes from the
    host's leader to rank 0.  That pair has a control connection already
    (:func:`ctrl_parents`, up to ``fanout`` + 1 hosts), which carries their ring's data
    too: rank 0 then holds a connection per rank of its host and per leader, and none to
    the job's last rank."""
    n = len(hosts)
    first = hosts.index(hosts[-1]) if n else 0
    if first == 0 or hosts[first:].count(hosts[-1]) != n - first:
        return list(range(n))
    return [*range(first), *range(n - 1, first - 1, -1)]


def eager_peers(rank, ring):
    """The peers a rank connects to at init: its neighbours on ``ring`` (the ranks in ring
    order, :func:`ring_order`)."""
    i, n = ring.index(rank), len(ring)
    return sorted({ring[i - 1], ring[(i + 1) % n]} - {rank})


def ctrl_parents(hosts, fanout=CTRL_FANOUT):
    """Every rank's control parent (None for rank 0), from every rank's host name
    (``hosts``): a host's ranks connect to its *leader* (its lowest rank), and the leaders
    to rank 0, or, in a job of more than ``fanout`` + 1 hosts, form a tree of ``fanout``
    children a leader (in host order: the hosts' leaders 1 .. ``fanout`` connect to rank 0,
    the next ``fanout`` to the first of them, and so on).  Rank 0's own host is led by its
    next rank, which connects to rank 0 beside the leaders (outside their tree), so that
    rank 0 reads one message for its host as for any other.  A job on one host of more than
    ``fanout`` + 1 ranks is led as hosts of :data:`GROUP` ranks (at most ``fanout``) would
    be, except that rank 0 leads its own group; on one host of fewer every rank connects to
    rank 0.  Rank 0 so holds a bounded number of control connections, whatever the job's
    size; a leader gathers the requests of the ranks below it
    (:mod:`hora.core.engine.relay`).  Where rank 0 answers a leader's ranks' board posts
    (on its own host), the leader passes their nudges up.  A parent is always a lower
    rank."""
    several = len(set(hosts)) > 1
    if len(hosts) > fanout + 1 and not several:
        group = min(GROUP, fanout)
        hosts = [r // group for r in range(len(hosts))]
    leader, leaders, parents = {}, [], []
    for r, host in enumerate(hosts):
        first = leader.setdefault(host, r)
        if first != r:
            parents.append(first)
            continue
        parents.append(None if r == 0 else leaders[(len(leaders) - 1) // fanout])
        leaders.append(r)
    home = [r for r in range(1, len(hosts)) if hosts[r] == hosts[0]]
    if several and len(home) > 1:
        for r in home[1:]:
            parents[r] = home[0]
    return parents


def ctrl_parent(rank, hosts, fanout=CTRL_FANOUT):
    """The rank that ``rank``'s control connection goes to (see :func:`ctrl_parents`)."""
    return ctrl_parents(hosts, fanout)[rank]


def ctrl_children(rank, hosts, fanout=CTRL_FANOUT):
    """The ranks whose control connections come to ``rank`` (see :func:`ctrl_parents`)."""
    return [r for r, parent in enumerate(ctrl_parents(hosts, fanout)) if parent == rank]


def ctrl_routes(rank, parents):
    """``{r: child}`` for every rank ``r`` below ``rank`` in the control tree
    (``parents``: :func:`ctrl_parents`): the child of ``rank`` whose connection leads to
    ``r`` (``r`` itself for a child)."""
    via = {}
    for r in range(rank + 1, len(parents)):
        p = parents[r]
        if p == rank:
            via[r] = r
        elif p in via:
            via[r] = via[p]
    return via


def ctrl_below(routes):
    """``{leader: (leader, every rank below it)}`` for each child in ``routes``
    (:func:`ctrl_routes`) that has ranks below it: the leaders whose desks gather others'."""
    below = {}
    for r, child in routes.items():
        if r != child:
            below.setdefault(child, [child]).append(r)
    return {leader: tuple(ranks) for leader, ranks in below.items()}


class Acceptor:
    """Authenticates the connections that come to ``listener``: data connections from the
    higher ranks and the control connections of ``ctrl_from`` (:func:`ctrl_children`);
    ``both``, one of ``ctrl_from`` that carries its data too (where pairs ``share``).

    All handshakes run at once in the calling thread (:class:`~hora.rendezvous.gate.
    HandshakeGate`), so connections that open and then say nothing (a port scanner, a
    stalled peer, hundreds of them) delay nobody.  Each ``(purpose, rank)`` is taken once: a
    connection claiming a rank that does not connect here, or one already connected, is
    refused, so an established peer cannot be replaced.
    """

    def __init__(self, listener, secret, rank, size, ctrl_from=(), share=False):
        self._rank = rank
        self._expected = {b"data": set(range(rank + 1, size)), b"ctrl": set(ctrl_from),
                          b"both": set(ctrl_from) if share else set()}
        self._taken = {b"data": set(), b"ctrl": set(), b"both": set()}
        self._gate = HandshakeGate(listener, secret,
                                   [p for p, peers in self._expected.items() if peers],
                                   _HANDSHAKE_S, trailer_bytes=RANK.size,
                                   on_refuse=self._refused)
        self._ready = collections.deque()
        self._stopping = False

    def missing(self, purpose):
        """The ranks whose ``purpose`` connections have not arrived."""
        return sorted(self._expected[purpose])

    def next(self, wait_until):
        """One authenticated ``(purpose, peer, socket)``, or None if none came by
        ``wait_until`` (monotonic; connections refused meanwhile are logged and dropped) or
        :meth:`wake` was called."""
        while not self._ready:
            left = wait_until - time.monotonic()
            if left <= 0 or self._stopping:
                return None
            for adm in self._gate.poll(left):
                (peer,) = RANK.unpack(adm.trailer)
                peers = self._expected[adm.purpose]
                if peer not in peers:
                    why = ("is already connected" if peer in self._taken[adm.purpose]
                           else "does not connect here")
                    self._refused(adm.addr, f"it authenticated, then claimed to be rank "
                                  f"{peer}, which {why} ({adm.purpose.decode()})")
                    adm.sock.close()
                    continue
                for purpose in _CLAIMS[adm.purpose]:
                    self._expected[purpose].discard(peer)
                    self._taken[purpose].add(peer)
                adm.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._ready.append((adm.purpose, peer, adm.sock))
        return self._ready.popleft()

    def wake(self):
        """Make :meth:`next`, running in another thread, return None now (thread-safe)."""
        self._stopping = True
        self._gate.wake()

    def _refused(self, addr, reason):
        log.warning("rank %d: refused a connection from %s: %s", self._rank, addr[0], reason)

    def close(self):
        """Stop: handshakes still running are cut off, authenticated sockets nobody took
        are closed."""
        self._gate.close()
        while self._ready:
            self._ready.popleft()[2].close()


class Links:
    """The connections that come to one rank's listener, taken by whoever needs them, and
    the dials to lower ranks: what :class:`~hora.backends.tcp.TcpTransport` opens a
    connection with (``open``) the first time it needs a peer.

    Args:
        listener: this rank's bound, listening socket (closed by :meth:`close`).
        secret: the mesh key.
        rank, size: this rank's place in the job.
        dial: ``dial(peer, purpose, deadline) -> socket``: an authenticated connection to a
            lower rank (raises :class:`~hora.errors.HoraRankFailedError` when it is gone).
        ctrl_from: the ranks whose control connections come here (:func:`ctrl_children`).
        share: control connections carry their pair's data too (a job on several hosts).
    """

    def __init__(self, listener, secret, rank, size, dial, ctrl_from=(), share=False):
        self.rank = rank
        self.share = share
        self._listener = listener
        self._dial = dial
        self._acceptor = Acceptor(listener, secret, rank, size, ctrl_from, share)
        self._cond = threading.Condition()
        self._arrived = {}              # (purpose, peer) -> socket nobody took yet
        self._shared = {}               # peer -> the control connection (mux.Shared) with it
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=f"hora-links-{rank}",
                                        daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._closed:
            try:
                got = self._acceptor.next(time.monotonic() + _SLICE_S)
            except Exception:   # noqa: BLE001 - a listener that failed: dials to it fail
                log.exception("rank %d: the listener for peer connections failed", self.rank)
                return
            if got is None:
                continue
            purpose, peer, sock = got
            if purpose != b"data" and self.share:
                sock = Shared(sock)
            with self._cond:
                if self._closed:
                    sock.close()
                    return
                self._arrived[(purpose, peer)] = sock
                if purpose != b"data" and self.share:
                    self._shared[peer] = sock
                self._cond.notify_all()

    def take(self, purpose, peer, wait_s):
        """The connection ``peer`` opened here for ``purpose``, waiting up to ``wait_s``
        seconds for it (a :class:`~hora.backends.mux.Shared` one for ``ctrl`` and ``both``
        where they share); None if it has not come."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                sock = self._arrived.pop((purpose, peer), None)
                left = deadline - time.monotonic()
                if sock is not None or self._closed or left <= 0:
                    return sock
                self._cond.wait(left)

    def dial(self, peer, purpose, deadline):
        """An authenticated ``purpose`` connection to the lower rank ``peer`` (a
        :class:`~hora.backends.mux.Shared` one for ``ctrl`` and ``both`` where they share)."""
        sock = self._dial(peer, purpose, deadline)
        if purpose == b"data" or not self.share:
            return sock
        shared = Shared(sock)
        with self._cond:
            self._shared[peer] = shared
        return shared

    def open(self, peer, wait_s):
        """A data connection to ``peer``: dialed when it is a lower rank, else the one it
        dialed here, waited for up to ``wait_s`` seconds (None if it has not come yet).
        Raises TransportBrokenError naming ``peer`` when it is gone.  A peer with a control
        connection to or from this rank: the data side of that connection."""
        with self._cond:
            shared = self._shared.get(peer)
        if shared is not None:
            return shared.data
        if peer > self.rank:
            return self.take(b"data", peer, wait_s)
        try:
            return self.dial(peer, b"data", time.monotonic() + max(wait_s, _HANDSHAKE_S))
        except HoraRankFailedError as e:
            raise TransportBrokenError(str(e), rank=peer) from e
        except RendezvousTimeoutError as e:       # its host does not answer
            raise CollectiveTimeoutError(f"rank {self.rank}: could not connect to rank "
                                         f"{peer}: {e}") from e

    def close(self):
        """Stop accepting; close the listener and the connections nobody took."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            left = list(self._arrived.values())
            self._arrived.clear()
            self._shared.clear()
            self._cond.notify_all()
        self._acceptor.wake()
        if self._thread is not threading.current_thread():
            self._thread.join(5)
        self._acceptor.close()
        self._listener.close()
        for sock in left:
            sock.close()
