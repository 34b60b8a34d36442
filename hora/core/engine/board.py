"""The board: blocking small allreduces of a one-host job, agreed and reduced in shared memory.

A blocking allreduce of at most :data:`BOARD_BYTES` bytes (``hora.allreduce``,
``hora.torch.allreduce_``, metric averaging, a barrier's token) spends most of its time in
the control path: a request to rank 0 over TCP, rank 0's negotiation, the answer back, and
two thread hand-offs.  When every rank is on this host, the calling thread can instead use
one segment of shared memory that every rank maps (the board):

- every other rank writes the collective's signature (name, op, dtype, shape, scale
  factors) and its prescaled input into its own slot, then its *post* word;
- rank 0, in its own call of the collective, waits until every rank has posted, checks that
  every signature equals its own, reduces the inputs in rank order into the result area
  (the engine's small path reduces in the same order, so the bits are the same), and
  writes each rank's *reply* word;
- each rank copies the result out.

No thread hand-off, no socket, no message: a few microseconds of Python on each side.

Rank 0 decides every post, and answers each exactly once, with the result or with *go
through the engine* (fallback).  It falls back whenever the board cannot settle the
collective for certain: the signatures differ, a rank has engine collectives in flight or
its requests reached the coordinator (it submitted this collective asynchronously, joined,
is leaving), rank 0 itself has collectives pending, or a post waited :data:`PATIENCE_S`
without its partners (a rank elsewhere in its program: the engine's stall inspector then
reports it as usual).  A rank told to fall back submits the collective to the engine as if
the board did not exist, so every case the board does not settle behaves exactly as before,
errors and all.  Rank 0 answers the posts it does not match from every engine step; a rank
whose post waits a millisecond sends rank 0 a :class:`~hora.core.wire.Nudge` so that a
sleeping engine there takes that step.

Waiting ranks poll the shared words (and the engine's life, which its thread keeps watching
over the sockets: a dead peer fails the call within seconds); they give up the CPU between
polls when this host has more ranks than CPUs.  A slot's data is rewritten only after every
rank posted its next collective, that is after every rank copied the last result out, so
one result area suffices.  The ordering of the words against the data relies on stores being
seen in program order (x86's TSO): the board is off on other machines.

Layer: core.
"""
import os
import platform
import time

import numpy as np

from ..fusion import scale
from ..messages import ALLREDUCE, Average
from .executor import REDUCE

__all__ = ["BOARD_BYTES", "PATIENCE_S", "Board", "board_bytes", "supported"]

BOARD_BYTES = 8 << 10       # the largest allreduce the board takes
PATIENCE_S = 1.0            # a post waits this long for its partners before the engine
NUDGE_S = 1e-3              # a post unanswered this long wakes rank 0's engine

_SIG_MAX = 256              # bytes of a slot for the signature
_ROW = 8                    # uint64 words of a rank's header row (one cache line)
_POST, _SIGLEN, _NBYTES, _REPLY = 0, 1, 2, 3
RESULT, FALLBACK = 1, 2     # a reply word is seq * 4 + one of these


def supported():
    """Whether this machine orders plain stores as the board needs (x86)."""
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def board_bytes(size, capacity=BOARD_BYTES):
    """The segment's size for ``size`` ranks."""
    return 64 * _ROW * size // 8 + size * _slot_bytes(capacity) + capacity


def _slot_bytes(capacity):
    return -(-(_SIG_MAX + capacity) // 64) * 64


class Board:
    """One rank's view of the board.

    Args:
        mapping: the shared segment (at least :func:`board_bytes` bytes), zeroed.
        rank, size: this rank's place in the job (every rank on this host).
        spin_s: how long a waiter polls without giving up the CPU.
        crowded: this host has more ranks than CPUs: yield the CPU between polls.
        capacity: the largest input in bytes.
    """

    def __init__(self, mapping, rank, size, spin_s, crowded, capacity=BOARD_BYTES):
        self.rank, self.size = rank, size
        self.capacity = capacity
        self.sig_max = _SIG_MAX
        self._map = mapping
        self._u8 = np.frombuffer(mapping, dtype=np.uint8)
        self._hdr = np.frombuffer(mapping, dtype=np.uint64, count=_ROW * size).reshape(size, _ROW)
        self._slot = _slot_bytes(capacity)
        self._slots = _ROW * 8 * size
        self._result = self._slots + size * self._slot
        self._spin_s = spin_s
        self._crowded = crowded
        self._sigs = {}                     # (name, op, dtype, shapes, scales) -> bytes
        self._seq = 0                       # this rank's posts so far
        # rank 0: per rank, the last post answered, and when an open post was first seen
        self._answered = [0] * size
        self._seen = {}                     # rank -> (seq, when rank 0 first saw it)

    # -- every rank -------------------------------------------------------------------------
    def takes(self, req):
        """Whether ``req`` is a collective the board can settle."""
        return (req.kind == ALLREDUCE and not req.device and req.process_set == 0
                and req.error is None)

    def signature(self, req):
        key = (req.name, req.op, req.dtype, req.shapes, req.prescale, req.postscale)
        sig = self._sigs.get(key)
        if sig is None:
            if len(self._sigs) > 4096:
                self._sigs.clear()
            sig = repr(key).encode()
            self._sigs[key] = sig
        return sig

    def pause(self, started, now):
        """Between two polls of a waiter that started at ``started``."""
        if self._crowded:
            os.sched_yield()
        elif now - started > self._spin_s:
            time.sleep(50e-6)

    # -- a worker (rank > 0) ------------------------------------------------------------------
    def post(self, sig, data):
        """Post this rank's ``sig`` and prescaled ``data`` (bytes-like); returns the post's
        sequence number, for :meth:`reply`."""
        off = self._slots + self.rank * self._slot
        n = len(data)
        self._u8[off:off + len(sig)] = np.frombuffer(sig, dtype=np.uint8)
        self._u8[off + _SIG_MAX:off + _SIG_MAX + n] = np.frombuffer(data, dtype=np.uint8)
        row = self._hdr[self.rank]
        row[_SIGLEN] = len(sig)
        row[_NBYTES] = n
        self._seq += 1
        row[_POST] = self._seq          # last: the data above is complete when this shows
        return self._seq

    def reply(self, seq):
        """Rank 0's answer to post ``seq``: RESULT, FALLBACK, or 0 (none yet)."""
        word = int(self._hdr[self.rank, _REPLY])
        return word & 3 if word >> 2 == seq else 0

    def wait_reply(self, seq, engine_alive, nudge):
        """Wait for rank 0's answer to post ``seq``; RESULT or FALLBACK, or None when the
        engine stopped meanwhile (the caller raises its failure)."""
        started = time.monotonic()
        nudged = False
        while True:
            got = self.reply(seq)
            if got:
                return got
            if not engine_alive():
                return None
            now = time.monotonic()
            if not nudged and now - started > NUDGE_S:
                nudged = True
                nudge()
            self.pause(started, now)

    def result(self, nbytes):
        """The last result's bytes (a view into the board: copy it out before posting again)."""
        return self._u8[self._result:self._result + nbytes]

    # -- rank 0 -------------------------------------------------------------------------------
    def open_posts(self):
        """``{rank: seq}`` of the posts rank 0 has not answered."""
        hdr, answered = self._hdr, self._answered
        out = {}
        for r in range(1, self.size):
            seq = int(hdr[r, _POST])
            if seq > answered[r]:
                out[r] = seq
        return out

    def answer(self, r, seq, what):
        self._answered[r] = seq
        self._seen.pop(r, None)
        self._hdr[r, _REPLY] = seq * 4 + what

    def fall_back(self, posts):
        for r, seq in posts.items():
            self.answer(r, seq, FALLBACK)

    def serve(self, busy, now):
        """Rank 0, outside a board call of its own: send the open posts to the engine when
        rank 0 is ``busy`` (collectives pending, requests at the coordinator, leaving) or
        when they waited :data:`PATIENCE_S`."""
        posts = self.open_posts()
        if not posts:
            return
        for r, seq in posts.items():
            first = self._seen.get(r)
            if first is None or first[0] != seq:
                self._seen[r] = first = (seq, now)
            if busy or now - first[1] >= PATIENCE_S:
                self.answer(r, seq, FALLBACK)

    def matches(self, posts, sig, nbytes):
        """Whether every open post in ``posts`` (every rank's) is the collective ``sig``."""
        hdr, u8 = self._hdr, self._u8
        for r in posts:
            if int(hdr[r, _SIGLEN]) != len(sig) or int(hdr[r, _NBYTES]) != nbytes:
                return False
            off = self._slots + r * self._slot
            if u8[off:off + len(sig)].tobytes() != sig:
                return False
        return True

    def reduce(self, req, own, posts):
        """Reduce rank 0's prescaled ``own`` bytes with every post's, in rank order, into the
        result area; answer every post with the result.  Returns the result's view."""
        dtype = np.dtype(req.dtype)
        n = len(own) // dtype.itemsize
        acc = self._u8[self._result:self._result + len(own)].view(dtype)
        acc[...] = np.frombuffer(own, dtype=dtype)
        fn = REDUCE[req.op]
        for r in range(1, self.size):
            off = self._slots + r * self._slot + _SIG_MAX
            fn(acc, self._u8[off:off + len(own)].view(dtype), out=acc)
        scale(acc, req.postscale, self.size if req.op == Average else 1)
        for r, seq in posts.items():
            self.answer(r, seq, RESULT)
        return acc[:n]

