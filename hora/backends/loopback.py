"""An in-process transport for unit tests: the ranks of a group are threads of one process.

:func:`loopback_group` returns ``size`` connected transports that keep the
:class:`~hora.backends.base.Transport` contract as :class:`~hora.backends.tcp.TcpTransport`
does, with nothing but memory in between:

- every ordered pair of ranks has a byte stream, bounded like a socket's buffers, so a
  sender blocks while its peer does not read (a schedule that would deadlock over TCP
  deadlocks here too, and fails after ``timeout``);
- a transfer that makes no progress for ``timeout`` seconds raises CollectiveTimeoutError;
- ``close()`` makes this rank's calls raise TransportClosedError, and every peer's waits
  raise TransportBrokenError naming this rank at once (bytes it sent before closing are
  still delivered, as TCP delivers them before the end of the stream);
- waits follow the transport's :class:`~hora.backends.base.WaitPolicy` (``spin_until``
  busy-polls, ``blame`` names the first of several lost peers).

Layer: backends.  Knows nothing of names or requests.
"""
import select
import threading
import time

from ..errors import CollectiveTimeoutError, TransportBrokenError, TransportClosedError
from .base import WaitPolicy

__all__ = ["LoopbackTransport", "loopback_group"]

_SLICE_S = 0.5          # longest sleep between two looks at the peers (as tcp's poll slice)
_FD_LOOK_S = 0.01       # how often watch() looks at its file descriptors


def loopback_group(size, timeout=30.0, capacity=1 << 20):
    """``size`` connected transports, rank ``r`` at index ``r``; each is used by its own
    thread(s).  ``capacity``: bytes a stream holds before its sender blocks."""
    if size < 1:
        raise ValueError(f"a loopback group needs at least one rank, not {size}")
    wire = _Wire(size, capacity)
    return [LoopbackTransport(wire, r, timeout) for r in range(size)]


class _Wire:
    """What the ranks of one group share: one byte stream per ordered pair of ranks, who
    has closed, and one condition that guards both and is notified on every change."""

    def __init__(self, size, capacity):
        self.size = size
        self.capacity = max(1, capacity)
        self.cond = threading.Condition()
        self.streams = {(a, b): bytearray() for a in range(size) for b in range(size)
                        if a != b}
        self.closed = [False] * size


class LoopbackTransport:
    """One rank's end of a :func:`loopback_group` (see the module docstring).

    Args:
        wire: the group's shared streams.
        rank: this rank.
        timeout: seconds a transfer may make no progress while every peer is open.
        policy: the :class:`~hora.backends.base.WaitPolicy` its waits follow; None: a
            fresh one.
    """

    def __init__(self, wire, rank, timeout=30.0, policy=None):
        self._wire = wire
        self.rank = rank
        self.size = wire.size
        self.timeout = timeout
        self.policy = WaitPolicy() if policy is None else policy

    # -- point to point -------------------------------------------------------------------
    def sendrecv(self, send_peer, send_buf, recv_peer, recv_buf, on_recv=None, step=1 << 18):
        """See :meth:`hora.backends.base.Transport.sendrecv`."""
        sends = [[send_peer, send_buf, 0]] if send_buf is not None and len(send_buf) else []
        recvs = [[recv_peer, recv_buf, 0]] if recv_buf is not None and len(recv_buf) else []
        self._transfer(sends, recvs, on_recv, step)

    def send(self, peer, buf):
        self.sendrecv(peer, buf, None, None)

    def recv(self, peer, buf, on_recv=None, step=1 << 18):
        self.sendrecv(None, None, peer, buf, on_recv, step)

    def exchange(self, sends, recvs):
        """See :meth:`hora.backends.base.Transport.exchange`."""
        self._transfer([[p, b, 0] for p, b in sends if len(b)],
                       [[p, b, 0] for p, b in recvs if len(b)], None, 0)

    def _transfer(self, sends, recvs, on_recv, step):
        """Move bytes until every ``[peer, buffer, done]`` of ``sends``/``recvs`` is done.
        ``on_recv`` follows the only receive (sendrecv)."""
        wire, policy = self._wire, self.policy
        tracked = recvs[0] if on_recv is not None and recvs else None
        reported = 0
        idle_since = time.monotonic()
        while sends or recvs:
            with wire.cond:
                moved, lost = self._move(sends, recvs)
                if moved:
                    wire.cond.notify_all()
                elif not lost:
                    now = time.monotonic()
                    if policy.spin(now):
                        continue
                    if now - idle_since > self.timeout:
                        peers = sorted({i[0] for i in sends + recvs})
                        raise CollectiveTimeoutError(
                            f"rank {self.rank}: no progress for {self.timeout:g} s moving "
                            f"bytes with ranks {peers} (loopback)")
                    lost = self._gone({i[0] for i in recvs})
                    if not lost:
                        wire.cond.wait(_SLICE_S)
            if lost:
                raise self._lost(lost)      # outside the lock: blame may take a while
            if moved:
                idle_since = time.monotonic()
                if tracked is not None:
                    got = tracked[2]
                    if got - reported >= step or (got == len(tracked[1]) and got > reported):
                        on_recv(got)
                        reported = got

    def _move(self, sends, recvs):
        """Under the lock: move what fits; drop finished items.  Returns (moved, peers
        whose end went away with nothing left to read)."""
        wire = self._wire
        if wire.closed[self.rank]:
            raise TransportClosedError("the transport was closed")
        moved = False
        for item in sends:
            peer, buf, done = item
            if wire.closed[peer]:
                return moved, [peer]
            stream = wire.streams[self.rank, peer]
            n = min(len(buf) - done, wire.capacity - len(stream))
            if n > 0:
                stream += buf[done:done + n]
                item[2] += n
                moved = True
        for item in recvs:
            peer, buf, done = item
            stream = wire.streams[peer, self.rank]
            n = min(len(buf) - done, len(stream))
            if n > 0:
                buf[done:done + n] = stream[:n]
                del stream[:n]
                item[2] += n
                moved = True
            elif wire.closed[peer]:
                return moved, [peer]
        sends[:] = [i for i in sends if i[2] < len(i[1])]
        recvs[:] = [i for i in recvs if i[2] < len(i[1])]
        return moved, None

    # -- liveness -------------------------------------------------------------------------
    def _gone(self, reading):
        """Under the lock: the peers that closed, less those of ``reading`` with bytes still
        to read (the receive takes those first)."""
        wire = self._wire
        return [p for p in range(self.size) if p != self.rank and wire.closed[p]
                and not (p in reading and wire.streams[p, self.rank])]

    def watch(self, fds=(), timeout=None, sends=(), recvs=()):
        """See :meth:`hora.backends.base.Transport.watch`."""
        wire, fds = self._wire, list(fds)
        poll = None
        if fds:
            poll = select.poll()
            for fd in fds:
                poll.register(fd, select.POLLIN)
        deadline = time.monotonic() + (_SLICE_S if timeout is None else timeout)
        woke = False
        while True:
            ready = {fd for fd, _ in poll.poll(0)} if poll is not None else set()
            with wire.cond:
                if wire.closed[self.rank]:
                    raise TransportClosedError("the transport was closed")
                lost = [] if ready else self._gone(set(recvs))
                left = deadline - time.monotonic()
                if not ready and not lost and left > 0 and not woke:
                    # with fds to watch, look at them now and then; else the first change
                    woke = wire.cond.wait(min(left, _FD_LOOK_S)) if poll is not None \
                        else wire.cond.wait(left)
                    continue
            if lost:
                raise self._lost(lost)
            return ready

    def _lost(self, peers):
        """The error for ``peers`` that closed; the policy's ``blame`` may know which of
        them went first."""
        if self._wire.closed[self.rank]:
            return TransportClosedError("the transport was closed")
        peer = self.policy.first_lost(peers)
        others = sorted(set(peers) - {peer})
        also = f" (and then lost ranks {others})" if others else ""
        return TransportBrokenError(f"lost connection to rank {peer}: it closed its loopback "
                                    f"transport{also}", rank=peer)

    def close(self):
        """See :meth:`hora.backends.base.Transport.close`."""
        with self._wire.cond:
            self._wire.closed[self.rank] = True
            self._wire.cond.notify_all()
