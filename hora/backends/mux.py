"""One TCP connection that carries two streams: a pair's control messages and its data.

Two ranks that need both a control connection (a rank and its control parent, see
:func:`hora.core.links.ctrl_parents`) and a data connection (ring neighbours, or any pair a
collective joins later) share one socket, so that a rank holds one connection per peer.

On a shared socket the control side writes its frames as it would on a socket of its own
(:mod:`hora.core.engine.conn`: a 4-byte big-endian length, the top bit set for a packed host
post); data goes in frames of its own, a 4-byte length with :data:`DATA` (bit 30) set, then
that many bytes.  Either side may read the other's bytes: a data read that meets a control
frame keeps it, in order, for the next control read (and calls :attr:`Shared.notify`, so
that a sleeping engine wakes for it: the socket no longer shows it readable); a control read
that meets data keeps it for the next data read (:meth:`DataEnd.buffered`).  A data read in
the middle of a data frame lands in the caller's buffer directly.

A frame the kernel took only part of is finished before the other side may send
(BlockingIOError meanwhile, as for a full socket); every operation holds the pair's lock, so
the engine thread and a caller's thread may each use one side.

Layer: backends.
"""
import select
import struct
import threading
import time

__all__ = ["Shared", "DATA"]

_HEAD = struct.Struct("!I")
_POST = 1 << 31                 # a control frame's length word: a packed host post follows
DATA = 1 << 30                  # a data frame's length word has this bit set
_FRAME_MAX = 1 << 22            # bytes of data a frame carries at most
_CHUNK = 1 << 16                # what one read of the other side's bytes takes at most
_IN_PLACE = 1 << 12             # a data read of this many bytes or more reads a header alone


def _ctrl_tail(chunk, at):
    """What is left to come of the last control frame (0: nothing) when ``chunk`` from
    ``at`` on holds control frames only, the last of them perhaps cut in its body (never in
    its length word); else None.  ``at`` past the end: the chunk is all body."""
    end = len(chunk)
    while at < end:
        if at + 4 > end:
            return None
        (word,) = _HEAD.unpack_from(chunk, at)
        if word & DATA and not word & _POST:
            return None
        at += 4 + (word ^ _POST if word & _POST else word)
    return at - end


class Shared:
    """A connected, non-blocking socket carrying a control stream (:attr:`ctrl`, used as
    :class:`hora.core.engine.conn.Conn`'s socket) and a data stream (:attr:`data`, one of
    :class:`hora.backends.tcp.TcpTransport`'s); :attr:`notify`: called (outside the lock)
    when a data read kept control bytes for the control side."""

    def __init__(self, sock):
        sock.setblocking(False)
        self.sock = sock
        self.notify = None
        self._lock = threading.Lock()
        # reading: the incoming frame's header so far, what is left of its body, whose it is
        self._head = bytearray()
        self._left = 0
        self._in_data = False
        self._ctrl_in = bytearray()     # control bytes a data read found
        self._stash = bytearray()       # data bytes a control read found
        self._scratch = bytearray(_CHUNK)   # what a data read takes at a frame's start
        # writing: the frame under way (None, or which side's), its unsent header and body
        self._owner = None
        self._out_head = b""
        self._out_left = 0
        self.ctrl = CtrlEnd(self)
        self.data = DataEnd(self)

    def fileno(self):
        return self.sock.fileno()

    def close(self):
        self.sock.close()

    # -- reading ---------------------------------------------------------------------------
    def _feed(self, chunk):
        """Sort bytes read from the socket into the two sides' keeps."""
        view = memoryview(chunk)
        at, end = 0, len(view)
        while at < end:
            if not self._left:
                take = min(4 - len(self._head), end - at)
                self._head += view[at:at + take]
                at += take
                if len(self._head) < 4:
                    break
                (word,) = _HEAD.unpack(self._head)
                self._in_data = not word & _POST and bool(word & DATA)
                if self._in_data:
                    self._left = word ^ DATA
                else:
                    self._left = word ^ _POST if word & _POST else word
                    self._ctrl_in += self._head
                self._head.clear()
                continue
            take = min(self._left, end - at)
            if self._in_data:
                self._stash += view[at:at + take]
            else:
                self._ctrl_in += view[at:at + take]
            self._left -= take
            at += take

    def recv_ctrl(self, bufsize):
        """Control bytes: b"" at the end of the stream, None when none has come (where a
        socket raises BlockingIOError: an engine step reads every control connection, and
        most have nothing)."""
        with self._lock:
            while not self._ctrl_in:
                try:
                    chunk = self.sock.recv(bufsize)
                except (BlockingIOError, InterruptedError):
                    return None
                if not chunk:
                    return b""
                if not self._head and not (self._left and self._in_data):
                    # (most reads: control bytes only, the rest of a frame cut by an earlier
                    # read, then frames, the last perhaps cut too: they go as they came)
                    tail = _ctrl_tail(chunk, self._left)
                    if tail is not None:
                        self._left, self._in_data = tail, False
                        return chunk
                self._feed(chunk)
                if len(chunk) < bufsize and not self._ctrl_in:
                    return None         # only data has come
            out = bytes(self._ctrl_in)
            self._ctrl_in.clear()
            return out

    def recv_data(self, buf):
        """Data bytes into ``buf``: how many (0 at the end of the stream; BlockingIOError
        when none)."""
        kept = False
        try:
            with self._lock:
                while True:
                    if self._stash:
                        n = min(len(buf), len(self._stash))
                        buf[:n] = self._stash[:n]
                        del self._stash[:n]
                        return n
                    left = self._left
                    if left and self._in_data:
                        n = self.sock.recv_into(buf, left if left < len(buf) else len(buf))
                        self._left = left - n
                        return n
                    # a header, or a control frame's body: read what has come (a header
                    # alone before a large read, whose data then land in place)
                    scratch = self._scratch
                    got = self.sock.recv_into(scratch, 0 if left or len(buf) < _IN_PLACE
                                              else 4 - len(self._head))
                    if not got:
                        return 0
                    if not left and not self._head and got > 4:
                        # (most reads: the start of one data frame, which fits in buf)
                        (word,) = _HEAD.unpack_from(scratch)
                        size, n = word ^ DATA, got - 4
                        if word & DATA and not word & _POST and n <= size and n <= len(buf):
                            buf[:n] = memoryview(scratch)[4:got]
                            self._left, self._in_data = size - n, True
                            return n
                    had = len(self._ctrl_in)
                    self._feed(memoryview(scratch)[:got])
                    kept = kept or len(self._ctrl_in) > had
        finally:                        # (a later turn may find nothing: BlockingIOError)
            if kept and self.notify is not None:
                self.notify()

    def buffered(self):
        """Whether data a control read found waits for the next data read."""
        return bool(self._stash)

    # -- writing ---------------------------------------------------------------------------
    def send_ctrl(self, data):
        """Send whole control frames, or the rest of the one under way: how many bytes the
        kernel took (BlockingIOError while a data frame is under way)."""
        with self._lock:
            owner = self._owner
            if owner is None:
                n = self.sock.send(data)
                if n < len(data):
                    self._owner, self._out_left = "ctrl", len(data) - n
                return n
            if owner != "ctrl":
                raise BlockingIOError("a data frame is under way")
            return self._go_on(data)

    def send_data(self, buf):
        """Send the start of ``buf`` as data: how many of its bytes the kernel took
        (BlockingIOError while a control frame is under way)."""
        with self._lock:
            owner = self._owner
            if owner is None:               # a new frame
                size = len(buf)
                if size > _FRAME_MAX:
                    size, buf = _FRAME_MAX, buf[:_FRAME_MAX]
                head = _HEAD.pack(DATA | size)
                sent = self.sock.sendmsg([head, buf])
                if sent == size + 4:
                    return size
                self._owner, self._out_head = "data", head[sent:]
                n = max(0, sent - 4)
                self._out_left = size - n
                return n
            if owner != "data":
                raise BlockingIOError("a control frame is under way")
            if self._out_head:
                self._out_head = self._out_head[self.sock.send(self._out_head):]
                if self._out_head:
                    raise BlockingIOError("a data frame's header is under way")
            return self._go_on(buf)

    def _go_on(self, buf):
        """(Holding the lock.)  Send more of the frame under way from ``buf``, the bytes
        that follow what was sent of it: how many the kernel took."""
        n = self.sock.send(buf[:self._out_left])
        self._out_left -= n
        if not self._out_left:
            self._owner = None
        return n

    def finish_data(self, rest, deadline):
        """After the transfer that sent it failed: send the rest of the data frame under
        way from ``rest`` (the bytes its sender had not sent yet), waiting for room until
        ``deadline`` (monotonic), so that control messages can follow it (a rank's last
        words).  The bytes are the real ones: a peer that reads them gets what it would
        have.  Whether the frame ended."""
        while self._owner == "data":
            try:
                rest = rest[self.send_data(rest):]
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                select.select([], [self.sock], [], 0.05)
            except OSError:
                return False
        return True


class _End:
    """One side of a :class:`Shared` socket, used as a socket: its own reads and writes,
    the shared socket's options and addresses (no other reads or writes: they would go
    around the framing)."""

    def __init__(self, shared):
        self.shared = shared
        sock = shared.sock
        self.fileno, self.setsockopt = sock.fileno, sock.setsockopt
        self.getsockname, self.getpeername = sock.getsockname, sock.getpeername
        self.shutdown = sock.shutdown       # (both sides: the connection's end)

    def setblocking(self, flag):
        """Both sides are non-blocking (a request for blocking is refused)."""
        if flag:
            raise ValueError("a shared connection's sides are non-blocking")

    def close(self):
        self.shared.close()


class CtrlEnd(_End):
    """The control side: ``send`` whole frames (:meth:`Shared.send_ctrl`), ``recv`` control
    bytes (:meth:`Shared.recv_ctrl`: None when none has come)."""

    def __init__(self, shared):
        super().__init__(shared)
        self.send, self.recv = shared.send_ctrl, shared.recv_ctrl     # (no call between)


class DataEnd(_End):
    """The data side: ``send`` and ``recv_into`` a byte stream (:meth:`Shared.send_data`,
    :meth:`Shared.recv_data`); ``buffered``: whether a control read kept data for it;
    ``finish``: :meth:`Shared.finish_data`."""

    def __init__(self, shared):
        super().__init__(shared)
        self.send, self.recv_into = shared.send_data, shared.recv_data
        self.buffered, self.finish = shared.buffered, shared.finish_data
