"""The server side of many handshakes at once, in the calling thread, never waiting on a peer.

A listener that gives each unauthenticated connection a thread (or a slot among a few) can
be held back by connections that open and say nothing: with 128 slots of 5 s each, 600 idle
sockets delayed a real rank by 20 s.  Here one selector reads every pending connection as its
bytes arrive and walks it through the handshake of :mod:`hora.rendezvous.protocol` (and,
optionally, a fixed-size trailer or one bounded frame after it), so a real client's
handshake completes as soon as its own bytes are in, however many idle ones wait beside it.
Memory is bounded: beyond ``max_pending`` unfinished connections the oldest is dropped, and
each one is dropped at its deadline.

Layer: rendezvous.  Imports only hora.errors and hora.rendezvous.protocol.
"""
import collections
import errno
import resource
import selectors
import socket
import struct
import time

from ..errors import AuthenticationError
from .protocol import ACK, HELLO, MAC, challenge, check_answer, open_hello, secret_key

__all__ = ["Admitted", "HandshakeGate", "MAX_PENDING"]

# a pending connection costs a file descriptor and ~200 bytes here; descriptors run out
# first, and the process needs them for more than this (its data plane, files): pending
# connections may take a quarter of them, at most MAX_PENDING
MAX_PENDING = 4096
_ACCEPT_BURST = 256     # connections accepted per wake-up before pending ones are read
_PAUSE_S = 0.1          # out of file descriptors with nothing to drop: look again this late
_LEN = struct.Struct("!I")

Admitted = collections.namedtuple("Admitted", "sock addr purpose trailer")
Admitted.__doc__ = """An authenticated connection: a blocking socket, the peer's address,
the purpose it asked for, and the bytes it sent after the handshake (``b""`` if none)."""

_HELLO, _ANSWER, _TRAILER, _FRAME_LEN, _FRAME, _DONE = range(6)


def _default_max_pending():
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_PENDING
    return max(64, min(MAX_PENDING, soft // 4))


class _Pending:
    __slots__ = ("sock", "addr", "deadline", "stage", "buf", "need", "out", "purpose",
                 "nonce_c", "nonce_s", "trailer")

    def __init__(self, sock, addr, deadline):
        self.sock, self.addr, self.deadline = sock, addr, deadline
        self.stage, self.buf, self.need, self.out = _HELLO, bytearray(), HELLO, b""
        self.purpose = self.nonce_c = self.nonce_s = None
        self.trailer = b""


class HandshakeGate:
    """Accepts on ``listener`` and authenticates every connection without blocking.

    Args:
        listener: a bound, listening socket (made non-blocking here; not closed here).
        secret: the key clients must prove they know (hex text or bytes).
        purposes: the purposes (4 bytes each) this listener serves.
        timeout: seconds from accept to the end of a connection's handshake (and trailer).
        trailer_bytes: after the handshake, read exactly this many bytes more.
        frame_limit: after the handshake, read one length-prefixed frame of at most this
            many bytes (None: none).  Exclusive with ``trailer_bytes``.
        on_refuse: ``on_refuse(addr, reason)`` for each connection dropped unauthenticated.
        max_pending: unfinished connections kept; beyond it, the oldest is dropped
            (default: a quarter of the file descriptors this process may open, at most
            ``MAX_PENDING``).
        clock: monotonic clock.
    """

    def __init__(self, listener, secret, purposes, timeout, trailer_bytes=0, frame_limit=None,
                 on_refuse=None, max_pending=None, clock=time.monotonic):
        if trailer_bytes and frame_limit is not None:
            raise ValueError("a gate reads a fixed trailer or a frame, not both")
        self._listener = listener
        self._key = secret_key(secret)
        self._purposes = tuple(purposes)
        self._timeout = timeout
        self._trailer_bytes = trailer_bytes
        self._frame_limit = frame_limit
        self._on_refuse = on_refuse or (lambda addr, reason: None)
        self._max_pending = max_pending or _default_max_pending()
        self._clock = clock
        self._pending = collections.OrderedDict()      # socket -> _Pending, oldest first
        self._paused_until = None
        listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)

    @property
    def pending(self):
        """How many connections are accepted and not yet authenticated."""
        return len(self._pending)

    def wake(self):
        """Make a :meth:`poll` running in another thread return now (thread-safe)."""
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def poll(self, timeout):
        """Accept, read and answer whatever has arrived, waiting up to ``timeout`` seconds
        for something to; return the connections that completed their handshake."""
        now = self._clock()
        self._expire(now)
        if self._paused_until is not None and now >= self._paused_until:
            self._paused_until = None
            self._sel.register(self._listener, selectors.EVENT_READ)
        wait = max(0.0, timeout)
        if self._pending:
            wait = min(wait, max(0.0, next(iter(self._pending.values())).deadline - now))
        if self._paused_until is not None:
            wait = min(wait, max(0.0, self._paused_until - now))
        admitted = []
        for key, mask in self._sel.select(wait):
            if key.fileobj is self._listener:
                self._accept()
            elif key.fileobj is self._wake_r:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except OSError:
                    pass
            else:
                p = key.data
                if p.sock not in self._pending:
                    continue                # dropped earlier in this round
                try:
                    if mask & selectors.EVENT_WRITE:
                        self._flush(p)
                    if mask & selectors.EVENT_READ:
                        self._read(p)
                except (AuthenticationError, OSError) as e:
                    self._refuse(p, str(e) or type(e).__name__)
                    continue
                if p.stage == _DONE and not p.out:
                    admitted.append(self._admit(p))
        self._expire(self._clock())
        return admitted

    def close(self):
        """Drop every pending connection and stop (the listener stays open)."""
        for p in list(self._pending.values()):
            self._drop(p)
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- internals ----------------------------------------------------------------------------
    def _accept(self):
        for _ in range(_ACCEPT_BURST):
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if self._pending:       # make room: the oldest has waited longest
                        self._refuse(next(iter(self._pending.values())),
                                     "dropped: out of file descriptors")
                        continue
                    self._sel.unregister(self._listener)
                    self._paused_until = self._clock() + _PAUSE_S
                    return
                if e.errno in (errno.ECONNABORTED, errno.EPROTO):
                    continue                # gone before we took it
                return                      # the listener was closed under us
            sock.setblocking(False)
            if len(self._pending) >= self._max_pending:
                self._refuse(next(iter(self._pending.values())),
                             f"dropped: more than {self._max_pending} connections waiting "
                             f"to authenticate")
            p = _Pending(sock, addr, self._clock() + self._timeout)
            self._pending[sock] = p
            self._sel.register(sock, selectors.EVENT_READ, p)

    def _read(self, p):
        while p.stage != _DONE:
            try:
                chunk = p.sock.recv(p.need - len(p.buf))
            except (BlockingIOError, InterruptedError):
                return
            if not chunk:
                if p.stage == _HELLO and not p.buf:     # a port probe: it sent nothing
                    self._drop(p)
                    return
                raise AuthenticationError("the connection closed during the handshake")
            p.buf += chunk
            if len(p.buf) < p.need:
                return
            data, p.buf = bytes(p.buf), bytearray()
            self._advance(p, data)

    def _advance(self, p, data):
        if p.stage == _HELLO:
            p.purpose, p.nonce_c = open_hello(data, self._purposes)
            p.nonce_s, reply = challenge(self._key, p.purpose, p.nonce_c)
            self._send(p, reply)
            p.stage, p.need = _ANSWER, MAC
        elif p.stage == _ANSWER:
            check_answer(self._key, p.purpose, p.nonce_c, p.nonce_s, data)
            self._send(p, ACK)
            if self._trailer_bytes:
                p.stage, p.need = _TRAILER, self._trailer_bytes
            elif self._frame_limit is not None:
                p.stage, p.need = _FRAME_LEN, _LEN.size
            else:
                p.stage = _DONE
        elif p.stage == _TRAILER:
            p.trailer, p.stage = data, _DONE
        elif p.stage == _FRAME_LEN:
            (n,) = _LEN.unpack(data)
            if n > self._frame_limit:
                raise AuthenticationError(f"first frame of {n} bytes exceeds "
                                          f"{self._frame_limit}")
            if n == 0:
                p.stage = _DONE
            else:
                p.stage, p.need = _FRAME, n
        elif p.stage == _FRAME:
            p.trailer, p.stage = data, _DONE

    def _send(self, p, data):
        p.out += data
        self._flush(p)

    def _flush(self, p):
        if p.out:
            try:
                p.out = p.out[p.sock.send(p.out):]
            except (BlockingIOError, InterruptedError):
                pass
        # a few dozen bytes into a fresh socket: the kernel takes them at once, save when the
        # peer stops reading; then wait until it can take them
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if p.out else 0)
        if self._sel.get_key(p.sock).events != events:
            self._sel.modify(p.sock, events, p)

    def _admit(self, p):
        del self._pending[p.sock]
        self._sel.unregister(p.sock)
        p.sock.setblocking(True)
        return Admitted(p.sock, p.addr, p.purpose, p.trailer)

    def _expire(self, now):
        while self._pending:
            p = next(iter(self._pending.values()))
            if p.deadline > now:
                return
            self._refuse(p, f"did not authenticate within {self._timeout:g} s")

    def _refuse(self, p, reason):
        # counted and logged before the close, which is what the peer sees
        try:
            self._on_refuse(p.addr, reason)
        finally:
            self._drop(p)

    def _drop(self, p):
        self._pending.pop(p.sock, None)
        try:
            self._sel.unregister(p.sock)
        except (KeyError, ValueError):
            pass
        p.sock.close()
