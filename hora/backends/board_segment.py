"""The board's shared-memory segment: its layout, its words, and the waits on them.

The board (:mod:`hora.core.engine.board`) settles small blocking collectives of the ranks of
one host in one segment that every rank maps.  This module is that segment and nothing of
collectives: where each rank's words, slot and areas lie, how a rank posts (a sequence
number in its *post* word, after the data), how the board's rank 0 answers (a word of the
post's number and one of four answers), how a waiter polls, yields and sleeps on a word (a
futex) and who wakes it.  What a post means, and what rank 0 answers, is the board's.

Layout (every offset a multiple of 64, a cache line)::

    size rows of ROW uint64 words    one per rank: post, signature length, bytes, reply,
                                     stripe done, asleep, ...; rank 0's row also has the
                                     doorbells every post and every stripe rings, and whether
                                     it is in a call of its own
    size slots                       one per rank: its signature (SIG_MAX bytes), the area of
                                     striped inputs (capacity), two small areas (below
                                     STRIPE_BYTES) that take turns, one round after the other
    the result area (capacity)       a striped round's and a host round's result

The ordering of the words against the data relies on stores being seen in program order
(x86's TSO): :func:`supported` is false on other machines, and the board is off there.

Layer: backends.
"""
import array
import os
import time

import numpy as np

from ..errors import CollectiveTimeoutError
from . import futex

__all__ = ["BOARD_BYTES", "STRIPE_BYTES", "SIG_MAX", "RESULT", "FALLBACK", "GO", "SHARED",
           "BoardSegment", "board_bytes", "board_capacity", "board_limit", "supported"]

BOARD_BYTES = 4 << 20       # the largest input a board takes (fewer bytes past 4 ranks)
SLOTS_BYTES = 16 << 20      # every slot together, at most: a board is a few of /dev/shm's MiB
SMALL_SHM_BYTES = 1 << 30   # a /dev/shm smaller than this (a container's 64 MiB) gets boards
SMALL_SHM_BOARD = 1 << 20   # of at most this: the shared-memory plane needs the room more
MIN_CAPACITY = 8 << 10      # the smallest board still takes a few hundred floats
STRIPE_BYTES = 64 << 10     # inputs from here have a striped area; below, two small areas
SIG_MAX = 256               # bytes of a slot for the signature
LINE = 64                   # bytes of a cache line: every area starts on one

# a rank's row: ROW uint64 words (two cache lines), of which these
ROW = 16
POST, SIGLEN, NBYTES, REPLY, DONE = 0, 1, 2, 3, 4
BELL, DONE_BELL = 5, 6      # rank 0's row only: rung by every post, by every stripe done
SIGVER = 7                  # how many signatures the rank has written into its slot
ASLEEP = 8                  # the rank sleeps on a futex: whoever changes its word wakes it
IN_CALL = 9                 # rank 0's row only: it is in a call of its own, which sees every
#                             post as it comes (a waiting rank need not wake its engine)
GATHERED = 10               # + a small area (0, 1): bytes a rank brings (the board's use)

# A reply word is ``seq << ANSWER_BITS | answer``: the post answered, and one of these
# (three bits hold them; a post's number takes the remaining 61, more than any job makes)
RESULT, FALLBACK, GO, SHARED = 1, 2, 3, 4
ANSWER_BITS = 3
ANSWER_MASK = (1 << ANSWER_BITS) - 1

# A futex compares 32 bits: a doorbell word carries the low 32 bits of ``seq << RANK_BITS |
# rank``, which differs from the last value any sleeper read (the pair is new) as long as
# fewer than 2**RANK_BITS ranks share the board (checked at start) and a sleeper does not
# miss 2**26 posts while it reads the word, its sleeps lasting at most SLEEP_S.
RANK_BITS = 10
MAX_RANKS = 1 << RANK_BITS
WORD32 = 0xFFFFFFFF

SLEEP_S = 2e-3              # a sleeping waiter wakes this often to look at its peers' lives
NAP_S = 50e-6               # a waiter past its spin budget on a host with CPUs to spare naps
#                             this long between looks: a timer slack's worth, tens of CPU-
#                             microseconds a second instead of a CPU
YIELDS = 16                 # yields between two full looks of a crowded host's waiter
ALONE_S = 1e-6              # a yield quicker than this gave the CPU to nobody
WATCH = 64                  # reads of the awaited word between two full looks, elsewhere
VIEWS_KEPT = 1024           # views of the segment kept for reuse (a loop asks for a few)


def supported():
    """Whether this machine orders plain stores as the board needs (x86-64 Linux, where the
    futex system call lets a waiter sleep on a word of the board)."""
    return futex.available()


_NAP_REF = futex.nap(SLEEP_S)
_fence = futex.fence
_wake = futex.wake


def board_limit(shm_bytes):
    """The largest input of any board on a host whose shared memory (``/dev/shm``) holds
    ``shm_bytes`` in all: :data:`BOARD_BYTES`, or :data:`SMALL_SHM_BOARD` where that is
    small (the same on every rank of the host)."""
    return BOARD_BYTES if shm_bytes >= SMALL_SHM_BYTES else SMALL_SHM_BOARD


def board_capacity(size, limit=BOARD_BYTES):
    """The largest input of a board of ``size`` ranks: ``limit`` (:func:`board_limit`), and at
    most :data:`SLOTS_BYTES` of slots in all (whole pages)."""
    return max(MIN_CAPACITY, min(limit, SLOTS_BYTES // size // 4096 * 4096))


def board_bytes(size, limit=BOARD_BYTES):
    """The segment's size for ``size`` ranks (and that ``limit``)."""
    capacity = board_capacity(size, limit)
    return 8 * ROW * size + size * _slot_bytes(capacity) + capacity


def _lines(nbytes):
    """``nbytes`` rounded up to whole cache lines."""
    return -(-nbytes // LINE) * LINE


def _small_bytes(capacity):
    """The size of each of a slot's two areas for inputs below STRIPE_BYTES."""
    return _lines(min(capacity, STRIPE_BYTES))


def _slot_bytes(capacity):
    """A slot: the signature, the area of striped inputs, two areas of small ones."""
    return SIG_MAX + _lines(capacity) + 2 * _small_bytes(capacity)


def doorbell(seq, rank):
    """The 32-bit value a doorbell takes when ``rank`` posts or finishes round ``seq``."""
    return ((seq << RANK_BITS) | rank) & WORD32


class BoardSegment:
    """One rank's view of the segment.

    Args:
        mapping: the shared segment (at least :func:`board_bytes` bytes), zeroed.
        rank, size: this rank's place among the ranks that map it.
        spin_s: how long a waiter polls before it sleeps.
        crowded: more ranks than CPUs share this rank's CPUs: waiters yield their CPU
            between looks, and then sleep on futexes rather than nap.
        timeout: seconds a rank waits for rank 0's answer, or for the others' stripes, while
            its engine lives; then :class:`~hora.errors.CollectiveTimeoutError`.
        far: the awaited ranks are tens of microseconds away (a board of host rounds): a
            crowded waiter sleeps at once rather than yield its CPU to them in vain.
        limit: the host's :func:`board_limit`.

    Rank 0 keeps, per other rank, the number of its next post (``next``: an open post has
    it), the signatures it read from each slot (``known``) and how often they changed
    (``epoch``).
    """

    def __init__(self, mapping, rank, size, spin_s, crowded, timeout, far=False,
                 limit=BOARD_BYTES):
        if size > MAX_RANKS:
            raise ValueError(f"a board serves at most {MAX_RANKS} ranks, not {size}")
        capacity = board_capacity(size, limit)
        self.rank, self.size, self.capacity = rank, size, capacity
        self.u8 = np.frombuffer(mapping, dtype=np.uint8)
        self.hdr = np.frombuffer(mapping, dtype=np.uint64, count=ROW * size).reshape(size, ROW)
        self.w = memoryview(mapping)[:8 * ROW * size].cast("Q")  # the words, one by one
        self.slot_bytes = _slot_bytes(capacity)
        self.small_bytes = _small_bytes(capacity)
        self.striped_bytes = _lines(capacity)   # the striped inputs' area of a slot
        self.slots_at = ROW * 8 * size
        self.result_at = self.slots_at + size * self.slot_bytes
        self.row = rank * ROW                   # this rank's row, in words
        self._spin_s, self._crowded, self._far = spin_s, crowded, far
        self.timeout = timeout
        self._base = self.hdr.ctypes.data       # the words' address, for the futexes
        self._ptrs = {}                         # word -> its address (ptr)
        self._bell = self.ptr(BELL)
        self._views = {}                        # (slot or -1, dtype, bytes, area) -> view
        self.seq = 0                            # this rank's posts so far
        self.reply_word = 0                     # the reply word as last read
        self.stripe_rounds = 0                  # striped rounds so far (the same everywhere)
        self.shared = 0                         # SHARED rounds so far (the same everywhere)
        self.last_sig = None                    # the signature in this rank's slot
        # rank 0: per other rank, its signature (version, bytes), its next post's number,
        # when an open post was first seen; and the lowest rank yet to post (open_posts)
        self.known = [(0, b"")] * size
        self.epoch = 0
        self.next = array.array("Q", [1] * size)
        self.seen = {}
        self.missing = None
        self.rows = tuple((r, r * ROW) for r in range(1, size))
        # rank 0: the other ranks' post words, signature versions and sleep flags (live views
        # of the words) and their next posts' numbers: each comparison of two of these is
        # one call, where a loop over the rows is three a rank
        w = self.w
        self.post_col, self.sigver_col = w[ROW + POST::ROW], w[ROW + SIGVER::ROW]
        self._asleep_col = w[ROW + ASLEEP::ROW]
        self.next_col = memoryview(self.next)[1:]
        self._awake = memoryview(bytes(8 * (size - 1))).cast("Q")

    # -- addresses and views ----------------------------------------------------------------
    def ptr(self, at):
        """The address of word ``at``, as the futex calls take it (made once: a waiter and a
        waker name the same few words on every call)."""
        ptr = self._ptrs.get(at)
        if ptr is None:
            ptr = self._ptrs[at] = futex.address(self._base, 8 * at)
        return ptr

    def small_area(self, r, area):
        """The byte offset of slot ``r``'s small area ``area`` (0 or 1)."""
        return (self.slots_at + r * self.slot_bytes + SIG_MAX + self.striped_bytes
                + area * self.small_bytes)

    def view(self, r, dtype, nbytes):
        """Where slot ``r`` holds an input of ``nbytes`` (the result area for -1), as a flat
        array of ``dtype`` (kept: a training loop asks for the same few again and again).

        An input of :data:`STRIPE_BYTES` or more goes to the slot's striped area.  A smaller
        one goes to one of two small areas, taking turns with each SHARED round: the last
        round's inputs may still be read by a slower rank when a rank posts again, but the
        round before it was read by everyone (each rank posted the last round after reading
        that one)."""
        area = 0 if nbytes >= STRIPE_BYTES else 1 + (self.shared & 1)
        key = (r, dtype, nbytes, area)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > VIEWS_KEPT:
                self._views.clear()
            off = (self.result_at if r < 0 else self.small_area(r, area - 1) if area
                   else self.slots_at + r * self.slot_bytes + SIG_MAX)
            view = self._views[key] = self.u8[off:off + nbytes].view(np.dtype(dtype))
        return view

    # -- waiting and waking -------------------------------------------------------------------
    def pause(self, started, now, bell=None, missing=None):
        """Between two looks of a waiter that started at ``started``.  On a crowded host it
        yields its CPU for the spin budget, then sleeps in the kernel (rank 0 on the
        doorbell, whose value it read as ``bell`` before looking at the posts; another rank
        on its reply word), and sleeps at once when its yields took no time: no other rank
        wanted this CPU, so the ranks awaited wait for another, and leaving this one idle is
        what makes the kernel move one of them here.  Elsewhere, for the spin budget, it
        watches the one word it waits for (its reply word, or rank 0 the post word of
        ``missing``, a rank yet to post) for a few reads before the next full look, then
        naps."""
        w = self.w
        if not self._crowded:
            if now - started > self._spin_s:
                time.sleep(NAP_S)
                return
            if missing is None:
                at, seen = self.row + REPLY, self.reply_word
            else:
                at, seen = missing * ROW + POST, self.next[missing] - 1
            for _ in range(WATCH):
                if w[at] != seen:
                    break
            return
        at, seen = (BELL, bell) if bell is not None else (self.row + REPLY, self.reply_word)
        if now - started < self._spin_s and not self._far:
            for _ in range(YIELDS):        # until the word changes, at little cost a turn
                os.sched_yield()
                if w[at] != seen:
                    return
            if time.monotonic() - now > YIELDS * ALONE_S:
                return
        self.sleep(self.ptr(at), seen & WORD32)

    def sleep(self, addr, seen):
        """Sleep on the word at ``addr`` while it holds ``seen`` (at most SLEEP_S), saying so
        in this rank's row first (:mod:`hora.backends.futex`: no wake-up is lost)."""
        w, at = self.w, self.row + ASLEEP
        w[at] = 1
        futex.sleep_on(addr, seen, _NAP_REF)
        w[at] = 0

    def rouse(self, r, addr, count=1):
        """After changing the word at ``addr`` on a crowded host: wake rank ``r`` (every
        sleeper when ``r`` is None) should it sleep on it."""
        _fence()
        if self.w[r * ROW + ASLEEP] if r is not None else self.hdr[:, ASLEEP].any():
            _wake(addr, count)

    def bell(self):
        """Rank 0 on a crowded host: the doorbell's value, read before looking at the posts."""
        return self.w[BELL] & WORD32 if self._crowded else None

    # -- posts and replies ------------------------------------------------------------------
    def write_sig(self, sig):
        """Put ``sig`` (bytes) in this rank's slot; rank 0 reads it when its version changes."""
        off = self.slots_at + self.rank * self.slot_bytes
        w, at = self.w, self.row
        self.u8[off:off + len(sig)] = np.frombuffer(sig, dtype=np.uint8)
        w[at + SIGLEN] = len(sig)
        w[at + SIGVER] += 1
        self.last_sig = sig

    def ring(self, nbytes):
        """Post what this rank's slot holds (``nbytes`` of input); returns the post's number."""
        w, at = self.w, self.row
        w[at + NBYTES] = nbytes
        seq = self.seq = self.seq + 1
        w[at + POST] = seq              # last: the data above is complete when this shows
        if self._crowded:               # rank 0 may sleep on the doorbell: a new value, a wake
            w[BELL] = doorbell(seq, self.rank)
            self.rouse(0, self._bell)
        return seq

    def reply(self, seq):
        """Rank 0's answer to post ``seq``: RESULT, FALLBACK, GO, SHARED, or 0 (none yet)."""
        word = self.reply_word = self.w[self.row + REPLY]
        return word & ANSWER_MASK if word >> ANSWER_BITS == seq else 0

    def wait_reply(self, seq, engine_alive, nudge, nudge_s, name):
        """Wait for rank 0's answer to post ``seq`` (of the collective ``name``): RESULT,
        FALLBACK, GO or SHARED, or None when the engine stopped meanwhile (the caller raises
        its failure).  ``nudge()`` once the post waited ``nudge_s`` and rank 0 is not in a
        call of its own: its engine may sleep."""
        started = None
        nudged = False
        while True:
            got = self.reply(seq)
            if got:
                return got
            if not engine_alive():
                return None
            now = time.monotonic()
            if started is None:
                started = now
            elif now - started > nudge_s:
                if not nudged and not self.w[IN_CALL]:
                    nudged = True
                    nudge()
                elif now - started > self.timeout:
                    raise CollectiveTimeoutError(
                        f"rank {self.rank}: rank 0 did not answer the shared-memory board "
                        f"about {name!r} within {self.timeout:g} s while its engine lived "
                        f"(HORA_TRANSPORT_TIMEOUT); is rank 0 stopped?")
            self.pause(started, now)

    # -- rank 0 -------------------------------------------------------------------------------
    def mark_in_call(self, flag):
        """Rank 0 enters (True) or leaves a call of its own (see :meth:`wait_reply`)."""
        self.w[IN_CALL] = flag

    def open_posts(self):
        """``{rank: seq}`` of the posts rank 0 has not answered; :attr:`missing` becomes the
        lowest rank without one (None: every rank posted)."""
        w, nxt = self.w, self.next
        out = {}
        missing = None
        for r, at in self.rows:
            seq = w[at + POST]
            if seq >= nxt[r]:
                out[r] = seq
            elif missing is None:
                missing = r
        self.missing = missing
        return out

    def read_sig(self, r):
        """Rank ``r``'s signature in its slot (read once per version; ``epoch`` counts the
        changes)."""
        w, at = self.w, r * ROW
        version = w[at + SIGVER]
        if self.known[r][0] != version:
            off = self.slots_at + r * self.slot_bytes
            self.known[r] = (version, self.u8[off:off + w[at + SIGLEN]].tobytes())
            self.epoch += 1
        return self.known[r][1]

    def answer(self, posts, what):
        """Answer each post of ``posts`` (``{rank: seq}``) with ``what``; then, on a crowded
        host, wake those of the ranks that sleep (one fence for all the answers)."""
        w, nxt, seen = self.w, self.next, self.seen
        for r, seq in posts.items():
            nxt[r] = seq + 1
            if seen:
                seen.pop(r, None)
            w[r * ROW + REPLY] = (seq << ANSWER_BITS) | what
        if self._crowded and posts:
            self._wake_replied(posts, what)

    def answer_open(self, what):
        """Answer every other rank's open post (each numbered as ``next`` says) with
        ``what``: :meth:`answer` when every post is known to be in, without the dict."""
        w, nxt = self.w, self.next
        for r, at in self.rows:
            seq = nxt[r]
            w[at + REPLY] = (seq << ANSWER_BITS) | what
            nxt[r] = seq + 1
        if self.seen:
            self.seen.clear()
        if self._crowded:
            self._wake_replied(None, what)

    def _wake_replied(self, ranks, what):
        """On a crowded host, after answering ``what``: wake those of ``ranks`` (None: every
        other rank) that sleep on their reply words.  After SHARED, yield the CPU too: a rank
        sharing this one then reduces and posts its next call first, and this rank's own
        post completes the next round (the last to post decides a round)."""
        _fence()
        if ranks is None:
            ranks = () if self._asleep_col == self._awake else range(1, self.size)
        w = self.w
        for r in ranks:
            if w[r * ROW + ASLEEP]:
                _wake(self.ptr(r * ROW + REPLY))
        if what == SHARED:
            os.sched_yield()

    # -- stripes ------------------------------------------------------------------------------
    def stripe(self, n):
        """This rank's stripe ``(lo, hi)`` of a striped input of ``n`` elements: whole cache
        lines of any dtype (a multiple of 16 elements)."""
        per = -(-n // self.size // 16) * 16
        return min(n, self.rank * per), min(n, (self.rank + 1) * per)

    def stripe_done(self):
        """Say that this rank reduced its stripe of the current striped round."""
        self.stripe_rounds += 1
        self.w[self.row + DONE] = self.stripe_rounds
        if self._crowded:
            self.w[DONE_BELL] = doorbell(self.stripe_rounds, self.rank)
            self.rouse(None, self.ptr(DONE_BELL), self.size)

    def wait_stripes(self, engine_alive, name):
        """Wait until every rank has reduced its stripe of this round (of the collective
        ``name``); False when the engine stopped meanwhile (a peer died: the caller raises the
        engine's failure)."""
        want, started = self.stripe_rounds, time.monotonic()
        done = self.hdr[:, DONE]
        while True:
            bell = self.w[DONE_BELL] & WORD32
            if (done >= want).all():
                return True
            if not engine_alive():
                return False
            waited = time.monotonic() - started
            if waited > self.timeout:
                late = [r for r in range(self.size) if done[r] < want]
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: rank(s) {late} did not reduce their stripes of "
                    f"{name!r} on the shared-memory board within {self.timeout:g} s while "
                    f"their engines lived (HORA_TRANSPORT_TIMEOUT); are they stopped?")
            if self._crowded:
                if waited < self._spin_s:
                    os.sched_yield()
                else:
                    self.sleep(self.ptr(DONE_BELL), bell)
            elif waited > self._spin_s:
                time.sleep(NAP_S)
