"""A control connection: typed messages (:mod:`hora.core.wire`), framed and pickled.

Each frame is a 4-byte big-endian length, then the pickle of the message's plain tuple
(:func:`hora.core.wire.encode`): plain data unpickles with no class lookup, which keeps a
small collective's round trip short.  A :class:`~hora.core.wire.HostPost`, the one message
of every small collective across hosts, travels without pickle: its length has the top bit
set, and its fields follow packed (``src``, ``seq``, the signature's length, the signature,
the data).  The socket is non-blocking: :meth:`Conn.receive`
returns what has arrived and never waits; :meth:`Conn.send` waits at most the transport
timeout for a peer that stops reading.

When a rank dies, the ranks that see it say so to the others (:func:`tell_dead`; rank 0
relays), so that a rank that sees several peers vanish at once can name the one that died
first (:func:`first_dead`).  Those looks leave what they read where it was
(:func:`heard`): rank 0's last words, an ``Abort`` that the hang-ups only followed, still
name the failure.

Layer: core.
"""
import logging
import pickle
import select
import struct
import time

from ...backends.tcp import watch_liveness
from ...errors import TransportBrokenError
from ...rendezvous.safepickle import PayloadRefusedError, SafeDecoder
from .. import stats
from ..wire import ALLOWED, Dead, HostPost, decode, encode

__all__ = ["Conn", "frame", "tell_dead", "first_dead", "heard"]

log = logging.getLogger(__name__)

_LEN = struct.Struct("!I")
_CHUNK = 1 << 16
_RAW = 1 << 31                          # in a frame's length: a packed host post follows
_POST = struct.Struct("!IiqH")          # its length | _RAW, src, seq, the signature's length

# what a control message may hold when the job key is derivable: plain data, and the few
# classes of wire.ALLOWED (requests; every field plain data too)
_PLAIN = SafeDecoder(ALLOWED).loads


def frame(msg):
    """``msg`` as the bytes of one frame."""
    if msg.__class__ is HostPost:
        sig, data = msg.sig, msg.data
        return (_POST.pack(_RAW | (_POST.size - 4 + len(sig) + len(data)), msg.src, msg.seq,
                           len(sig)) + sig + data)
    payload = pickle.dumps(encode(msg), protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(payload)) + payload


class Conn:
    """A non-blocking, framed, pickled control connection (authenticated beforehand).

    ``plain_only``: decode frames as plain data and :data:`hora.core.wire.ALLOWED` only,
    for a job whose key is derivable from public values, where a peer that knows the key
    may be anyone; with a real secret only the job's own ranks can connect, and frames are
    unpickled as they are (about a microsecond less per small collective).
    """

    def __init__(self, sock, peer, timeout, plain_only=False):
        self.sock = sock
        self.peer = peer
        self.timeout = timeout
        self._decode = _PLAIN if plain_only else pickle.loads
        self._buf = bytearray()
        self.held = []          # read, not taken (receive_only): receive() returns them first
        self.closed = False     # the peer's end was seen closed (messages may still be held)
        sock.setblocking(False)
        watch_liveness(sock)

    def fileno(self):
        return self.sock.fileno()

    def send(self, msg):
        self.send_frame(frame(msg))

    def send_frame(self, data):
        """Send the bytes of a frame (:func:`frame`): one message framed once for several
        connections."""
        count = stats.counters.ctrl
        count[2] += 1
        count[3] += len(data)
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as e:
            raise TransportBrokenError(f"lost the control connection to rank {self.peer}: "
                                       f"{e}", rank=self.peer) from e
        if sent < len(data):                # the socket's buffer is full: wait for room
            self._send_rest(memoryview(data)[sent:])

    def _send_rest(self, data):
        deadline = time.monotonic() + self.timeout
        while data:
            try:
                data = data[self.sock.send(data):]
            except (BlockingIOError, InterruptedError):
                if time.monotonic() > deadline:
                    raise TransportBrokenError(f"rank {self.peer} stopped reading control "
                                               f"messages for {self.timeout:g} s", rank=self.peer)
                select.select([], [self.sock], [], 0.5)
            except OSError as e:
                raise TransportBrokenError(f"lost the control connection to rank {self.peer}: "
                                           f"{e}", rank=self.peer) from e

    def receive(self):
        """Every complete message that has arrived (never blocks).

        Messages that arrived before the peer closed are returned first; the close is
        reported (TransportBrokenError) by the call that finds nothing else to return.
        Messages put back in :attr:`held` come before those read now.
        """
        eof = None
        while True:
            try:
                chunk = self.sock.recv(_CHUNK)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                eof = TransportBrokenError(f"lost the control connection to rank {self.peer}: "
                                           f"{e}", rank=self.peer)
                break
            if chunk is None:       # (a connection that carries data too: nothing more)
                break
            if not chunk:
                eof = TransportBrokenError(f"rank {self.peer} closed its control connection "
                                           f"(the process exited or was killed)", rank=self.peer)
                break
            self._buf += chunk
            stats.counters.ctrl[1] += len(chunk)
            if len(chunk) < _CHUNK:
                break       # drained for now; a close behind it is seen by the next call
        out, self.held = self.held, []
        before = len(out)
        buf = self._buf
        at, end = 0, len(buf)
        with memoryview(buf) as view:   # (frames decode in place; the buffer shrinks once)
            while end - at >= 4:
                (n,) = _LEN.unpack_from(buf, at)
                if n & _RAW:
                    stop = at + 4 + (n ^ _RAW)
                    if end < stop:
                        break
                    fields = _POST.unpack_from(buf, at) if stop - at >= _POST.size else None
                    if fields is None or _POST.size + fields[3] > stop - at:
                        raise TransportBrokenError(f"rank {self.peer} sent a malformed host "
                                                   f"post", rank=self.peer)
                    sig = at + _POST.size + fields[3]
                    out.append(HostPost(fields[1], fields[2], bytes(view[at + _POST.size:sig]),
                                        bytes(view[sig:stop])))
                    at = stop
                    continue
                stop = at + 4 + n
                if end < stop:
                    break
                try:
                    out.append(decode(self._decode(view[at + 4:stop])))
                except (PayloadRefusedError, ValueError) as e:
                    self._buf = bytearray()     # (the error's frames may still view the old)
                    log.error("rank %s sent a control message that is not plain data; "
                              "dropping its connection: %s", self.peer, e)
                    raise TransportBrokenError(f"rank {self.peer} sent a control message hora "
                                               f"refuses: {e}", rank=self.peer) from e
                at = stop
        del buf[:at]
        stats.counters.ctrl[0] += len(out) - before
        if eof is not None:
            self.closed = True
            if not out:
                raise eof
        return out

    def receive_only(self, cls):
        """The messages of class ``cls`` that have arrived (never blocks); the others stay,
        in order, for the next :meth:`receive`.  Returns them, and whether any others
        stay."""
        got = []
        for msg in self.receive():
            if msg.__class__ is cls:
                got.append(msg)
            else:
                self.held.append(msg)
        return got, bool(self.held)

    def send_nowait(self, msg):
        """Best effort, never blocks: for last words when the job is already broken."""
        try:
            self.sock.send(frame(msg))
        except OSError:
            pass


def tell_dead(conns, rank, message):
    """Tell every peer of ``conns`` but ``rank`` itself that ``rank`` died (best effort)."""
    for conn in conns:
        if conn.peer != rank:
            conn.send_nowait(Dead(rank, message))


def first_dead(conns, clock, parent, wait_s=0.2):
    """The rank that died first, if a :class:`~hora.core.wire.Dead` message arrives on
    ``conns`` within ``wait_s`` (else None).

    Rank 0 relays deaths (and a host's leader between its host and rank 0); when this rank's
    ``parent`` (rank 0 or its leader; None on rank 0) is gone without a word (its control
    connection closed with no Dead message before the close), the parent is named: had
    another rank died before, it would have said so before failing.  That holds even when
    the parent is not among the peers the transport lost: a rank starved of CPU may see a
    survivor that already gave up hang up before it sees its parent's own hang-up."""
    deadline = clock() + wait_s
    while True:
        for msg in heard(conns):
            if msg.__class__ is Dead:
                return msg.rank
        if clock() >= deadline:
            if parent is not None and any(c.closed and c.peer == parent for c in conns):
                return parent
            return None
        select.select([c.sock for c in conns], [], [], 0.02)


def heard(conns):
    """Every message that has arrived on ``conns``, left in place for their next
    :meth:`Conn.receive` (never blocks; of a closed connection, what came before the close)."""
    out = []
    for conn in conns:
        try:
            messages = conn.receive()
        except TransportBrokenError:
            continue
        conn.held = messages        # (receive() returned the held ones first)
        out.extend(messages)
    return out
