"""The TCP transport: authenticated connections to peers, non-blocking, full duplex.

The transport moves bytes and watches peers; it knows nothing of tensor names or requests.
It starts with the connections its owner opened (a rank's ring neighbours) and opens any
other the first time a transfer needs it, through its ``links`` (:mod:`hora.core.links`).
Every wait is a ``poll`` in slices of at most a second that also watches every other
connected peer for a hang-up, so a peer that dies (kill -9: the kernel closes its sockets)
is noticed within one slice by every rank connected to it, even ranks that are not talking
to it right now; the others learn it from those (their failure closes their connections) or
from the control plane (the policy's ``blame``).

Satisfies :class:`~hora.backends.base.NetworkTransport`.

Layer: backends.  Imports hora.errors and hora.backends.base only.
"""
import errno
import math
import logging
import select
import socket
import threading
import time

from ..errors import CollectiveTimeoutError, TransportBrokenError, TransportClosedError
from .base import WaitPolicy
from .mux import DataEnd

__all__ = ["TcpTransport"]

log = logging.getLogger(__name__)

_POLLRDHUP = getattr(select, "POLLRDHUP", 0x2000)
_HANGUP = select.POLLHUP | select.POLLERR | select.POLLNVAL | _POLLRDHUP
_SLICE_MS = 500
_MAX_SEND = 4 << 20
_SOCKBUF = 0
_FINISH_S = 0.5             # a failed transfer's frames under way get this long to end


# A peer whose host vanishes (power, network: no FIN, no RST) is declared gone by the kernel
# after about this long: keepalive probes while the connection is idle, and a limit on how
# long sent data may stay unacknowledged while it is not.  A live peer's kernel answers both
# even when the process is stopped or busy, so they never fire for a slow rank.
LIVENESS_S = 4


def watch_liveness(sock, seconds=LIVENESS_S):
    """Make the kernel fail ``sock`` (POLLERR, ETIMEDOUT) once its peer's host has been
    silent for about ``seconds``.  No-op where the options do not exist."""
    opts = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1),
                        ("TCP_KEEPCNT", max(1, seconds - 1)),
                        ("TCP_USER_TIMEOUT", int(seconds * 1000))):
        if hasattr(socket, name):
            opts.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, opt, value in opts:
        try:
            sock.setsockopt(level, opt, value)
        except OSError:
            pass                # not TCP (a Unix socket pair in tests)


def tune_socket(sock):
    """Low latency, liveness, and large kernel buffers for a data connection."""
    watch_liveness(sock)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass                    # not TCP (a Unix socket pair in tests)
    for opt in ((socket.SO_SNDBUF, socket.SO_RCVBUF) if _SOCKBUF else ()):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKBUF)
        except OSError:
            pass


def _finish(sends):
    """A transfer failed: complete the data frame under way on each of ``sends``
    (``(socket, the bytes not sent yet)``) that carries control messages too
    (:mod:`hora.backends.mux`), so that this rank's last words reach those peers; within
    _FINISH_S in all (a peer that does not read meanwhile gets no last words)."""
    deadline = time.monotonic() + _FINISH_S
    for sock, rest in sends:
        if sock.__class__ is DataEnd:
            sock.finish(rest, deadline)


class TcpTransport:
    """Point-to-point byte movement between the ranks of one job.

    Args:
        rank, size: this process's place in the job.
        socks: ``{peer_rank: connected socket}``, the connections opened so far.
        timeout: seconds a transfer may make no progress while every peer is alive.
        policy: the :class:`~hora.backends.base.WaitPolicy` its waits follow (spin or
            sleep, whom to blame for a lost peer), shared with its owner; None: a fresh one.
        links: how a connection to another peer is opened when first needed:
            ``links.open(peer, wait_s)`` returns a connected socket, or None if it is not
            there yet (the peer dials), and raises TransportBrokenError when the peer is
            gone; ``links.close()`` ends them.  None: ``socks`` are all there is.
        ring: the ranks in the order of the job's ring (:func:`hora.core.links.ring_order`),
            which :mod:`hora.backends.ring`'s schedules follow; None: rank order.
    """

    def __init__(self, rank, size, socks, timeout=300.0, policy=None, links=None, ring=None):
        self.rank = rank
        self.size = size
        self.ring = tuple(range(size)) if ring is None else tuple(ring)
        self.timeout = timeout
        self._socks = {}
        self._rank_of_fd = {}
        self._polls = threading.local()     # one (poll object, fds it watches) per thread
        self._links = links
        self._opening = threading.Lock()
        self._opening_peer = {}
        self._closed = False
        self.policy = WaitPolicy() if policy is None else policy
        for peer, sock in socks.items():
            self._add(peer, sock)

    def _add(self, peer, sock):
        sock.setblocking(False)
        tune_socket(sock)
        # new dicts, not changed ones: other threads' waits read them without the lock
        with self._opening:
            self._rank_of_fd = {**self._rank_of_fd, sock.fileno(): peer}
            self._socks = {**self._socks, peer: sock}

    def _sock(self, peer):
        """The connection to ``peer``, opened now if it is the first transfer with it."""
        sock = self._socks.get(peer)
        return sock if sock is not None else self._open(peer)

    def _open(self, peer):
        if self._links is None or not 0 <= peer < self.size or peer == self.rank:
            raise TransportBrokenError(f"rank {self.rank} has no connection to rank {peer}",
                                       rank=peer)
        with self._opening:                 # one opening per peer: two threads never dial it
            lock = self._opening_peer.setdefault(peer, threading.Lock())
        with lock:
            since = time.monotonic()
            while peer not in self._socks:
                if self._closed:
                    raise TransportClosedError("the transport was closed")
                sock = self._links.open(peer, _SLICE_MS / 1000)
                if sock is not None:
                    self._add(peer, sock)
                    break
                self.watch(timeout=0)       # raises if a connected peer hung up meanwhile
                if time.monotonic() - since > self.timeout:
                    raise CollectiveTimeoutError(
                        f"rank {self.rank}: rank {peer} did not connect within "
                        f"{self.timeout:g} s (HORA_TRANSPORT_TIMEOUT)")
        return self._socks[peer]

    @property
    def peers(self):
        """The ranks this transport is connected to now."""
        return sorted(self._socks)

    # -- the liveness-watching wait -------------------------------------------------------
    def watch(self, fds=(), timeout=None, sends=(), recvs=()):
        """Wait until one of ``fds``, or a socket of the ``sends``/``recvs`` peers being
        written/read, is ready.

        Raises TransportBrokenError naming the rank when any other peer hangs up.  Returns the
        set of ready fds among ``fds`` (empty on timeout).
        """
        if self._closed:
            raise TransportClosedError("the transport was closed")
        poll = getattr(self._polls, "poll", None)
        if poll is None:
            poll = self._polls.poll = select.poll()
            self._polls.fds = set()
        if len(self._polls.fds) != len(self._rank_of_fd):      # a connection was opened
            for fd in self._rank_of_fd.keys() - self._polls.fds:
                poll.register(fd, _POLLRDHUP)
                self._polls.fds.add(fd)
        # the callers' fds; a peer's among them (a control connection that carries its
        # data, hora.backends.mux) keeps its hang-up watch
        mine = self._polls.fds
        extra = [fd for fd in fds if fd not in mine]
        for fd in extra:
            poll.register(fd, select.POLLIN)
        active = dict.fromkeys((fd for fd in fds if fd in mine), select.POLLIN)
        ms = _SLICE_MS if timeout is None else max(0, math.ceil(timeout * 1000))
        for peer in sends:
            fd = self._sock(peer).fileno()
            active[fd] = active.get(fd, 0) | select.POLLOUT
        for peer in recvs:
            sock = self._sock(peer)
            fd = sock.fileno()
            active[fd] = active.get(fd, 0) | select.POLLIN
            if sock.__class__ is DataEnd and sock.buffered():
                ms = 0                  # a control read found its data: no need to wait
        for fd, ev in active.items():
            poll.modify(fd, ev | _POLLRDHUP)
        try:
            events = poll.poll(ms)
        finally:
            for fd in extra:
                poll.unregister(fd)
            for fd in active:
                poll.modify(fd, _POLLRDHUP)
        wanted = set(fds)
        ready = {fd for fd, ev in events if fd in wanted and ev & ~select.POLLOUT}
        gone = []
        for fd, ev in events:
            peer = self._rank_of_fd.get(fd)
            if peer is None or not ev & _HANGUP:
                continue
            if fd in active and active[fd] & select.POLLIN and not ev & select.POLLERR:
                continue            # the receive itself will read what is left, then EOF
            gone.append(peer)
        if gone and not ready:
            raise self._lost(gone)
        return ready

    def _lost(self, peers):
        """The error for peers that hung up; the policy's ``blame`` may know which of them
        died first."""
        peer = self.policy.first_lost(peers)
        others = sorted(set(peers) - {peer})
        also = f" (and then lost ranks {others})" if others else ""
        return TransportBrokenError(f"lost connection to rank {peer}: the process exited or "
                                    f"its host is unreachable{also}", rank=peer)

    # -- point to point -------------------------------------------------------------------
    def sendrecv(self, send_peer, send_buf, recv_peer, recv_buf, on_recv=None, step=1 << 18):
        """Send ``send_buf`` to one peer while receiving ``recv_buf`` from another.

        Both buffers are byte memoryviews (either may be None or empty).  ``on_recv(n)`` is
        called each time at least ``step`` more bytes have arrived (and at the end) with the
        number of bytes received so far, so the caller can reduce while data still flows.
        """
        slen = 0 if send_buf is None else len(send_buf)
        rlen = 0 if recv_buf is None else len(recv_buf)
        ssock = self._sock(send_peer) if slen else None
        rsock = self._sock(recv_peer) if rlen else None
        sent = recvd = reported = 0
        policy = self.policy
        idle_since = time.monotonic()
        try:
            while sent < slen or recvd < rlen:
                moved = False
                if sent < slen:
                    try:
                        sent += ssock.send(send_buf[sent:sent + _MAX_SEND])
                        moved = True
                    except (BlockingIOError, InterruptedError):
                        pass
                    except OSError as e:
                        raise self._broken(send_peer, e) from e
                if recvd < rlen:
                    try:
                        n = rsock.recv_into(recv_buf[recvd:])
                    except (BlockingIOError, InterruptedError):
                        n = -1
                    except OSError as e:
                        raise self._broken(recv_peer, e) from e
                    if n == 0:
                        raise self._broken(recv_peer, None)
                    if n > 0:
                        recvd += n
                        moved = True
                        if on_recv is not None and (recvd - reported >= step or recvd == rlen):
                            on_recv(recvd)
                            reported = recvd
                if moved:
                    idle_since = time.monotonic()
                    continue
                now = time.monotonic()
                if policy.spin(now):
                    continue
                if now - idle_since > self.timeout:
                    raise CollectiveTimeoutError(
                        f"rank {self.rank}: no progress for {self.timeout:g} s sending to rank "
                        f"{send_peer} ({sent}/{slen} bytes) and receiving from rank {recv_peer} "
                        f"({recvd}/{rlen} bytes)")
                self.watch(sends=[send_peer] if sent < slen else (),
                           recvs=[recv_peer] if recvd < rlen else ())
        except Exception:          # (a frame to a peer alive is finished: see _finish)
            if sent < slen:
                _finish([(ssock, send_buf[sent:])])
            raise

    def exchange(self, sends, recvs):
        """Send and receive with several peers at once: ``sends``/``recvs`` are lists of
        ``(peer, byte memoryview)``, at most one of each per peer.  For small messages,
        where one round trip costs more than the bytes."""
        sends = [[p, b, 0] for p, b in sends if len(b)]
        recvs = [[p, b, 0] for p, b in recvs if len(b)]
        socks = {item[0]: self._sock(item[0]) for item in sends + recvs}
        policy = self.policy
        idle_since = time.monotonic()
        try:
            while sends or recvs:
                moved = False
                for item in sends:
                    try:
                        item[2] += socks[item[0]].send(item[1][item[2]:item[2] + _MAX_SEND])
                        moved = True
                    except (BlockingIOError, InterruptedError):
                        pass
                    except OSError as e:
                        raise self._broken(item[0], e) from e
                for item in recvs:
                    try:
                        n = socks[item[0]].recv_into(item[1][item[2]:])
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError as e:
                        raise self._broken(item[0], e) from e
                    if n == 0:
                        raise self._broken(item[0], None)
                    item[2] += n
                    moved = True
                sends = [i for i in sends if i[2] < len(i[1])]
                recvs = [i for i in recvs if i[2] < len(i[1])]
                if moved:
                    idle_since = time.monotonic()
                elif sends or recvs:
                    now = time.monotonic()
                    if policy.spin(now):
                        continue
                    if now - idle_since > self.timeout:
                        raise CollectiveTimeoutError(
                            f"rank {self.rank}: no progress for {self.timeout:g} s exchanging with "
                            f"ranks {sorted({i[0] for i in sends + recvs})}")
                    self.watch(sends=[i[0] for i in sends], recvs=[i[0] for i in recvs])
        except Exception:
            _finish([(socks[item[0]], item[1][item[2]:]) for item in sends])
            raise

    def send(self, peer, buf):
        self.sendrecv(peer, buf, None, None)

    def recv(self, peer, buf, on_recv=None, step=1 << 18):
        self.sendrecv(None, None, peer, buf, on_recv, step)

    def _broken(self, peer, err):
        if self._closed:
            return TransportClosedError("the transport was closed")
        how = "closed the connection" if err is None or getattr(
            err, "errno", None) in (errno.ECONNRESET, errno.EPIPE) else f"failed: {err}"
        if self.policy.blame is not None:
            first = self.policy.blame([peer])
            if first is not None and first != peer:
                return self._lost([first, peer])
        return TransportBrokenError(f"rank {peer} {how} (the process exited or was killed)",
                                    rank=peer)

    def addresses(self, peer):
        """(this end's, the peer's) IP address of the connection to ``peer``: where another
        data plane (gloo) can meet that peer on the same network."""
        sock = self._sock(peer)
        return sock.getsockname()[0], sock.getpeername()[0]

    def close(self):
        """See :meth:`hora.backends.base.Transport.close`."""
        if self._closed:
            return
        self._closed = True
        if self._links is not None:
            self._links.close()
        for sock in list(self._socks.values()):
            try:
                sock.close()
            except OSError:
                pass
