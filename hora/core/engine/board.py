"""The board: blocking allreduces and barriers of a one-host job (and its small broadcasts and
allgathers), settled in shared memory.

A blocking allreduce of at most :data:`BOARD_BYTES` bytes (``hora.allreduce``,
``hora.torch.allreduce_``, metric averaging) or a blocking ``barrier()`` spends most of its
time in the control path: a request to rank 0 over TCP, rank 0's negotiation, the answer
back, and two thread hand-offs (and, above 8 KiB, the data plane's two barriers).
When every rank is on this host, the calling thread can instead use one segment of shared
memory that every rank maps (the board):

- every other rank writes the collective's signature (name, kind, op, dtype, shape, scale
  factors) and its prescaled input into its own slot, then its *post* word;
- rank 0, in its own call of the collective, puts its own prescaled input in its slot, waits
  until every rank has posted, checks that every signature equals its own, and writes each
  rank's *reply* word: *shared*;
- each rank reduces every slot's input in rank order, straight into its own result (as the
  engine's path for inputs up to 8 KiB does, so that those results are the same bits either
  way; every rank computes the same bits in any case).

One float32 or float64 number (a loss, a metric) summed or averaged without a prescale
skips numpy: each rank writes it into its slot and adds the slots up in Python floats,
rounding to the dtype after each addition, which gives numpy's bits (see ``_scalar``); a
numpy call costs most of a microsecond, and more after another process had the CPU.

Small inputs take turns between two areas of each slot, one SHARED round after the other: a
rank may post its next input while a slower rank still reads the last round's, but never
before every rank has read the round before it (each posted the last round after reading
that one, holding the board meanwhile).  From :data:`STRIPE_BYTES`, where reducing every
input on every rank would cost more than the hand-off saves, rank 0 replies *go* instead:
every rank reduces one stripe of the result area (every slot's elements there, in rank
order), says so in its *done* word, and copies the result out once every stripe is done.
Nobody else reads a rank's own stripe of its input, so from :data:`_UNSTAGED_BYTES` (one
contiguous array, no prescale) it stays out of the slot and is read from the caller's array;
below that the two partial copies cost more Python than they save
(docs/performance-notes.md).
A barrier carries no data: rank 0's reply (*result*) releases it.

Blocking broadcasts and allgathers of one host array below STRIPE_BYTES a rank, on one host,
take SHARED rounds too: the root alone stages its input (the others post the signature),
and every rank copies the root's slot; or every rank stages its input, with its byte count
in its row (one word per small area: a rank may post its next call while a slower one still
reads this), and every rank copies every slot in rank order.  An allgather's signature
leaves out the first dimension, which may differ from rank to rank.

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

Waiting ranks poll the shared words, and the engine's life, which its thread keeps watching
over the sockets (a dead peer fails the call within seconds); a rank alive but stopped in the
middle of a call (its stripe undone, or rank 0's answer) fails the others' waits after
HORA_TRANSPORT_TIMEOUT, as a stalled transfer does.  When this host has more ranks than CPUs,
polling would take a CPU from the rank being waited for: waiters then yield their CPU between
looks (``sched_yield``, as MPI's ranks do when oversubscribed) for the spin budget, and
after that sleep in the kernel on a word of the board (a futex: a worker on its reply word,
rank 0 on a doorbell that every post rings), saying so in their row, so that whoever changes
the word wakes them, and only them.  A waiter whose yields give the CPU to nobody sleeps at
once: it has a CPU to itself while the ranks it waits for share another, and an idle CPU is
what makes the kernel move one of them over.  Rank 0 yields once after answering, so that a
rank sharing its CPU posts its next call first and rank 0's own post completes the round.

Across hosts (the hierarchical plane: shared memory in each host) every host has a board of
its own, whose rank 0 is the host's *leader* (its lowest rank; global rank 0 leads the first
host), for the calls below :data:`STRIPE_BYTES`.  A job on several hosts whose data plane is
the TCP ring (one rank a host, or hosts of different sizes) has them too; a host of one rank
keeps a board of one in its own memory, and its host's partial result is its own input.
The leaders play *host rounds*, numbered alike on every leader.  A leader waits for its
host's posts as rank 0 does, reduces them in rank order and sends every other leader the
host's partial result in a :class:`~hora.core.wire.HostPost` of the round (rank 0 sends its
own to each leader, and relays each leader's to the others: the only control connections
are with rank 0); when every leader has posted the same collective, each adds the hosts'
partials in host order (the same bits everywhere), applies the postscale and answers its
host's posts (*result*: the result is in the host's result area).  One message from each
leader, sent at once, and no answer to wait for: the hosts settle a round in one network
latency, not the two of a request to rank 0 and its answer.

A leader that posted a round is committed to it; one that has not may *veto* it instead (an
empty HostPost, which names the leader's own call when it is in one), and must when it is
busy, when its host's posts differ or did not all come within :data:`PATIENCE_S`, when
another leader vetoed the round, or when another leader
urges it to: a leader whose round waited PATIENCE_S for the others says so, and so does
rank 0 as soon as its engine has work under way (another rank submitted a collective there,
perhaps this one, asynchronously).  A vetoed round (or one whose posts differ) sends every
host's posts of it to the engine, on every host alike, as rank 0's fallback does in one
host.  A leader outside a board call vetoes, from its engine's steps, a round another leader
posted when it is busy or urged, or after PATIENCE_S; a round vetoed meanwhile is over for it
too, and its host's ranks send that round's collective (named by a post or by the veto) to
the engine when they come to it.

The result area (of the stripes, and of the hosts' results) is rewritten only after every
rank posted its next collective, that is after every rank copied the last result out, so one
suffices.  The ordering of the words against the data relies on stores being seen in program
order (x86's TSO): the board is off on other machines.

Layer: core.
"""
import array
import os
import threading
import time

import numpy as np

from ...backends import futex
from ...errors import CollectiveTimeoutError, TransportBrokenError
from .. import stats, timeline
from ..fusion import scale
from ..messages import ALLGATHER, ALLREDUCE, BROADCAST, Average, Sum
from .executor import REDUCE
from .folds import add_up, copy_out, fold, pack, times

__all__ = ["BOARD_BYTES", "STRIPE_BYTES", "PATIENCE_S", "RESULT", "FALLBACK", "GO", "SHARED",
           "Board", "Lane", "board_bytes", "board_capacity", "board_limit",
           "waited",
           "supported"]

BOARD_BYTES = 4 << 20       # the largest allreduce the board takes (fewer bytes past 4 ranks)
SMALL_SHM_BYTES = 1 << 30   # a /dev/shm smaller than this (a container's 64 MiB) gets boards
SMALL_SHM_BOARD = 1 << 20   # of at most this: the shared-memory plane needs the room more
STRIPE_BYTES = 64 << 10     # from this size every rank reduces a stripe of the result
_UNSTAGED_BYTES = 256 << 10  # from this size a rank's own stripe of its input is not staged
PATIENCE_S = 1.0            # a post waits this long for its partners before the engine
NUDGE_S = 1e-3              # a post unanswered this long wakes rank 0's engine
ROUND = "ALLREDUCE board"   # the timeline's span of a lane's round

_SIG_MAX = 256              # bytes of a slot for the signature
_ROW = 16                   # uint64 words of a rank's header row (two cache lines)
_POST, _SIGLEN, _NBYTES, _REPLY, _DONE = 0, 1, 2, 3, 4
_BELL, _DONE_BELL = 5, 6    # rank 0's row only: rung by every post, by every stripe done
_SIGVER = 7                 # how many signatures the rank has written into its slot
_ASLEEP = 8                 # the rank sleeps on a futex: whoever changes its word wakes it
_GATHERED = 10              # + a small area (0, 1): the bytes of the rank's allgather input
_SLEEP_S = 2e-3             # a sleeping waiter looks at its engine (and rank 0 at its sockets)
_YIELDS = 16                # yields between two full looks of such a waiter
_ALONE_S = 1e-6             # a yield quicker than this gave the CPU to nobody
_WATCH = 64                 # reads of the awaited word between two full looks, elsewhere
_SCALAR_OPS = (Sum, Average)   # a one-element float allreduce of these: Python floats
_NEVER = (1 << 64) - 1      # a signature version no slot has (Lane.vers: another collective's)
# the ufuncs a lane calls with a positional output, 150 ns cheaper than ``out=`` (NumPy
# deprecates it for np.maximum and np.minimum)
_POSITIONAL = (np.add, np.multiply)
# a reply word is seq * 8 + one of these: RESULT (in the result area), FALLBACK, GO (reduce
# a stripe), SHARED (every input is in its slot: reduce them all yourself)
RESULT, FALLBACK, GO, SHARED = 1, 2, 3, 4


def supported():
    """Whether this machine orders plain stores as the board needs (x86-64 Linux, where the
    futex system call lets a waiter sleep on a word of the board)."""
    return futex.available()


_NAP_REF = futex.nap(_SLEEP_S)
_now = time.monotonic       # (the timeline's clock, one lookup cheaper)
_fence = futex.fence
_wake = futex.wake


def _sleep_on(addr, seen):
    """Sleep until the 32-bit word at ``addr`` (a ``c_void_p``: :meth:`Board._ptr`) no longer
    holds ``seen``, someone wakes it, or _SLEEP_S passes (:mod:`hora.backends.futex`: the
    waiter says it sleeps before this call, so no wake-up is lost)."""
    futex.sleep_on(addr, seen, _NAP_REF)


def board_limit(shm_bytes):
    """The largest input of any board on a host whose shared memory (``/dev/shm``) holds
    ``shm_bytes`` in all: :data:`BOARD_BYTES`, or :data:`SMALL_SHM_BOARD` where that is
    small (the same on every rank of the host)."""
    return BOARD_BYTES if shm_bytes >= SMALL_SHM_BYTES else SMALL_SHM_BOARD


def board_capacity(size, limit=BOARD_BYTES):
    """The largest input of a board of ``size`` ranks: ``limit`` (:func:`board_limit`), and at
    most 16 MiB of slots in all."""
    return max(8 << 10, min(limit, (16 << 20) // size // 4096 * 4096))


def board_bytes(size, limit=BOARD_BYTES):
    """The segment's size for ``size`` ranks (and that ``limit``)."""
    capacity = board_capacity(size, limit)
    return 8 * _ROW * size + size * _slot_bytes(capacity) + capacity


def _lines(nbytes):
    """``nbytes`` rounded up to whole cache lines."""
    return -(-nbytes // 64) * 64


def _small_bytes(capacity):
    """The size of each of a slot's two areas for inputs below STRIPE_BYTES."""
    return _lines(min(capacity, STRIPE_BYTES))


def _slot_bytes(capacity):
    """A slot: the signature, the area of striped inputs, two areas of small ones."""
    return _SIG_MAX + _lines(capacity) + 2 * _small_bytes(capacity)


class Board:
    """One rank's view of the board.

    Args:
        mapping: the shared segment (at least :func:`board_bytes` bytes), zeroed.
        rank, size: this rank's place in the job (every rank on this host).
        spin_s: how long a waiter polls before it sleeps.
        crowded: more ranks than CPUs share this rank's CPUs: waiters yield their CPU
            between looks, and then sleep on futexes rather than nap.
        timeout: seconds a worker waits for rank 0's answer, and a rank for the others'
            stripes, while their engines live (HORA_TRANSPORT_TIMEOUT: a rank stopped in the
            middle of a call); then :class:`~hora.errors.CollectiveTimeoutError`.
        leaders: in a job on several hosts, the global rank of every host's leader (its
            board's rank 0), in host order, global rank 0 first; None: one host.
        job_size: the job's size (an Average divides by it); None: ``size``.
        limit: the host's :func:`board_limit` (the segment has :func:`board_bytes` of it).
    """

    def __init__(self, mapping, rank, size, spin_s, crowded, timeout=300.0, leaders=None,
                 job_size=None, limit=BOARD_BYTES):
        capacity = board_capacity(size, limit)
        self.rank, self.size = rank, size
        self.capacity = capacity
        self.sig_max = _SIG_MAX
        self._map = mapping
        self._u8 = np.frombuffer(mapping, dtype=np.uint8)
        self._hdr = np.frombuffer(mapping, dtype=np.uint64, count=_ROW * size).reshape(size, _ROW)
        self._slot = _slot_bytes(capacity)
        self._small = _small_bytes(capacity)
        self._striped = _lines(capacity)    # the striped inputs' area of a slot
        self._slots = _ROW * 8 * size
        self._result = self._slots + size * self._slot
        self._spin_s = spin_s
        self._crowded = crowded             # sleep in the kernel rather than poll
        self._timeout = timeout
        self.leaders = tuple(leaders or (0,))
        self.job_size = size if job_size is None else job_size
        if len(self.leaders) > 1:   # across hosts the hierarchical ring does better at that
            self.capacity = min(capacity, STRIPE_BYTES - 1)
        # a worker of a board across hosts waits for the other hosts, tens of microseconds
        # away: on a crowded host its yields would only slow the leaders, so it sleeps
        self._far = rank > 0 and len(self.leaders) > 1
        # for the one-element sums (_scalar), per dtype (float32, float64): a view of the
        # whole segment as numbers of it, a scratch number, slot 0's number in each SHARED
        # round's area (0, 1; the areas take turns), and each slot's distance from slot 0
        whole = memoryview(mapping).cast("B")
        self._scalars = {np.dtype(f).str: (whole[:len(whole) // n * n].cast(f),
                                           memoryview(bytearray(n)).cast(f),
                                           (self._small_area(0, 0) // n,
                                            self._small_area(0, 1) // n),
                                           tuple(range(0, size * self._slot // n,
                                                       self._slot // n)))
                         for f, n in (("f", 4), ("d", 8))}
        self._scalar_of = (None, None)      # the last request _scalar() saw, and its answer
        self._w = memoryview(mapping)[:8 * _ROW * size].cast("Q")  # the words, cheaper to
        self._base = self._hdr.ctypes.data  # read one by one; their address, for the futexes
        self._ptrs = {}                     # word -> its address as a c_void_p (_ptr)
        self._at = rank * _ROW              # this rank's row, in words
        self._bell = self._ptr(_BELL)       # the doorbell's address
        self._sigs = {}                     # (name, op, dtype, shapes, scales) -> bytes
        self._seq = 0                       # this rank's posts so far
        self._fence = threading.Lock()      # a fence as futex.fence's (one board call at a time)
        self._mine = None                   # this rank's input, when its stripe is not staged
        self._last_sig = None               # the signature in this rank's slot
        self._reply_word = 0                # the reply word as reply() last read it
        self._round = 0                     # striped reductions so far (the same everywhere)
        self._shared = 0                    # SHARED reductions so far (the same everywhere)
        self._inputs = {}                   # (dtype, bytes, area) -> slots' views, a buffer
        #                                     (dtype, each rank's bytes, area) -> slots' views
        self._partials = {}                 # (dtype, bytes, area) -> result area's, slots'
        self._views = {}                    # (slot or -1: the result, dtype, bytes, area) -> view
        self._known = [(0, b"")] * size     # rank 0: each rank's (signature version, bytes)
        self._epoch = 0                     # rank 0: how often _known changed (Lane.epoch)
        # rank 0: per rank, the number of its next post (one more than the last answered:
        # an open post has it), and when an open post was first seen
        self._next = array.array("Q", [1] * size)
        self.missing = None                 # rank 0: see open_posts()
        self._seen = {}                     # rank -> (seq, when rank 0 first saw it)
        self._rows = tuple((r, r * _ROW) for r in range(1, size))  # rank 0: (rank, its row)
        # rank 0: the other ranks' post words, signature versions and sleep flags (live
        # views of the words), their next posts' numbers, and no rank asleep: each
        # comparison of two of these is one call, where a loop over the rows is three a rank
        w = self._w
        self._post_col, self._sigver_col = w[_ROW + _POST::_ROW], w[_ROW + _SIGVER::_ROW]
        self._asleep_col = w[_ROW + _ASLEEP::_ROW]
        self._next_col = memoryview(self._next)[1:]
        self._awake = memoryview(bytes(8 * (size - 1))).cast("Q")

    # -- every rank -------------------------------------------------------------------------
    def signature(self, req):
        shapes = req.shapes
        if req.kind == ALLGATHER:       # the ranks' numbers of rows may differ
            shapes = tuple(s[1:] for s in shapes)
        key = (req.name, req.kind, req.op, req.root, req.dtype, shapes, req.prescale,
               req.postscale)
        sig = self._sigs.get(key)
        if sig is None:
            if len(self._sigs) > 4096:
                self._sigs.clear()
            sig = repr(key).encode()
            self._sigs[key] = sig
        return sig

    def pause(self, started, now, bell=None, missing=None):
        """Between two polls of a waiter that started at ``started``.  On a crowded host it
        yields its CPU for the spin budget, then sleeps in the kernel (rank 0 on the
        doorbell, whose value it read as ``bell`` before looking at the posts; a worker on
        its reply word), and sleeps at once when its yields took no time (no other rank
        wanted this CPU, so those awaited wait for another; see the module's docstring);
        elsewhere, for the spin budget, it watches the one word it waits
        for (a worker its reply word, rank 0 the post word of ``missing``, a rank that has
        not posted) for a few microseconds before the next full look, then naps."""
        if not self._crowded:
            if now - started > self._spin_s:
                time.sleep(50e-6)
                return
            w = self._w
            if missing is None:
                at, seen = self.rank * _ROW + _REPLY, self._reply_word
            else:
                at, seen = missing * _ROW + _POST, self._next[missing] - 1
            for _ in range(_WATCH):
                if w[at] != seen:
                    break
        else:
            # the word's value when the waiter found nothing new: the doorbell's for rank 0,
            # the reply word's (as reply() read it) for a worker
            at, seen = (_BELL, bell) if bell is not None else (self.rank * _ROW + _REPLY,
                                                                self._reply_word)
            if now - started < self._spin_s and not self._far:
                w = self._w
                for _ in range(_YIELDS):    # until the word changes, at little cost a turn
                    os.sched_yield()
                    if w[at] != seen:
                        return
                if time.monotonic() - now > _YIELDS * _ALONE_S:
                    return
                # no yield gave the CPU away: nobody else wants it, so the rank awaited
                # waits for a CPU elsewhere; sleeping leaves this one idle, and the kernel
                # then moves a waiting rank here
            self._sleep(self._ptr(at), seen & 0xFFFFFFFF)

    def _sleep(self, addr, seen):
        """Sleep on the word at ``addr`` while it holds ``seen`` (see :func:`_fence`)."""
        w, at = self._w, self.rank * _ROW + _ASLEEP
        w[at] = 1
        _sleep_on(addr, seen)
        w[at] = 0

    def _rouse(self, r, addr, count=1):
        """After changing the word at ``addr``: wake rank ``r`` (every sleeper when ``r`` is
        None) should it sleep on it."""
        _fence()
        if self._w[r * _ROW + _ASLEEP] if r is not None else self._hdr[:, _ASLEEP].any():
            _wake(addr, count)

    def bell(self):
        """Rank 0 on a crowded host: the doorbell's value, read before looking at the posts."""
        return self._w[_BELL] & 0xFFFFFFFF if self._crowded else None

    def _view(self, r, dtype, nbytes):
        """Where slot ``r`` holds an input of ``nbytes`` (the result area for -1), as a flat
        array of ``dtype`` (kept: a training loop asks for the same few again and again).

        An input of :data:`STRIPE_BYTES` or more goes to the slot's striped area.  A smaller
        one goes to one of two small areas, taking turns with each SHARED reduction: the
        last SHARED round's inputs may still be read by a slower rank when a rank posts
        again, but the round before it was read by everyone (each rank posted the last
        round after reading that one, holding the board throughout)."""
        area = 0 if nbytes >= STRIPE_BYTES else 1 + (self._shared & 1)
        key = (r, dtype, nbytes, area)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 1024:
                self._views.clear()
            off = (self._result if r < 0 else self._small_at(r) if area
                   else self._slots + r * self._slot + _SIG_MAX)
            view = self._views[key] = self._u8[off:off + nbytes].view(np.dtype(dtype))
        return view

    def _word(self, r, field):
        return self._ptr(r * _ROW + field)

    def _ptr(self, at):
        """The address of the board's word ``at``, as the futex calls take it (made once:
        a waiter and a waker name the same few words on every call)."""
        ptr = self._ptrs.get(at)
        if ptr is None:
            ptr = self._ptrs[at] = futex.address(self._base, 8 * at)
        return ptr

    # -- a worker (rank > 0) ------------------------------------------------------------------
    def post(self, sig, req, arrays, nbytes):
        """Post this rank's ``sig`` and its input: ``arrays`` (``nbytes`` in all) times the
        prescale factor of ``req``.  Returns the post's sequence number, for :meth:`reply`."""
        if sig is not self._last_sig:   # a training loop posts the same few again and again
            self._write_sig(sig)
        self.stage(req, arrays, nbytes)
        return self._ring(nbytes)

    def _write_sig(self, sig):
        """Put ``sig`` in this rank's slot (rank 0 reads it when its version changes)."""
        off = self._slots + self.rank * self._slot
        w, at = self._w, self.rank * _ROW
        self._u8[off:off + len(sig)] = np.frombuffer(sig, dtype=np.uint8)
        w[at + _SIGLEN] = len(sig)
        w[at + _SIGVER] += 1
        self._last_sig = sig

    def _ring(self, nbytes):
        """Post what this rank's slot holds (``nbytes`` of input); returns the post's
        sequence number."""
        w, at = self._w, self._at
        w[at + _NBYTES] = nbytes
        seq = self._seq = self._seq + 1
        w[at + _POST] = seq             # last: the data above is complete when this shows
        if self._crowded:               # rank 0 may sleep on the doorbell: a new value, a wake
            w[_BELL] = (seq * 64 + self.rank) & 0xFFFFFFFF
            fence = self._fence         # (_rouse(0, ...), without its calls)
            fence.acquire()
            fence.release()
            if w[_ASLEEP]:              # (rank 0's row)
                _wake(self._bell)
        return seq

    def stage(self, req, arrays, nbytes):
        """Put this rank's input (``arrays``, ``nbytes`` in all, times the prescale factor of
        ``req``) in its slot; from _UNSTAGED_BYTES, one contiguous array without a prescale
        leaves out this rank's stripe, which :meth:`reduce_stripe` reads from the array.  Of
        a broadcast, only the root stages its input; of an allgather, each rank also writes
        its byte count into its row."""
        self._mine = None
        if req.kind != ALLREDUCE:
            if req.kind == ALLGATHER:   # (the others read it after SHARED: gathered())
                self._w[self.rank * _ROW + _GATHERED + (self._shared & 1)] = nbytes
            elif req.kind == BROADCAST and req.root != self.rank:
                return                  # only the root's input is read: copy_shared()
        elif nbytes <= 8 and len(arrays) == 1:
            scalar = self._scalar(req, nbytes)
            if scalar is not None:      # (item(): the value as a Python float, exactly)
                view, _, first, apart = scalar
                view[first[self._shared & 1] + apart[self.rank]] = arrays[0].item()
                return
        if not nbytes:
            return                      # a barrier, or an empty allreduce
        dst = self._view(self.rank, req.dtype, nbytes)
        if nbytes >= _UNSTAGED_BYTES and req.prescale == 1 and len(arrays) == 1:
            a = arrays[0]
            if a.flags.c_contiguous and a.dtype == dst.dtype:
                # this rank alone reads its own stripe (reduce_stripe): from ``a`` itself
                mine = self._mine = a.reshape(-1)
                lo, hi = self._stripe(mine.size)
                if lo:
                    np.copyto(dst[:lo], mine[:lo])
                if hi < mine.size:
                    np.copyto(dst[hi:], mine[hi:])
                return
        pack(dst, arrays)
        if req.prescale != 1:
            scale(dst, req.prescale, 1)

    def reply(self, seq):
        """Rank 0's answer to post ``seq``: RESULT, FALLBACK, GO, SHARED, or 0 (none yet)."""
        word = self._reply_word = self._w[self.rank * _ROW + _REPLY]
        return word & 7 if word >> 3 == seq else 0

    def wait_reply(self, seq, engine_alive, nudge, name):
        """Wait for rank 0's answer to post ``seq`` (of the collective ``name``); RESULT,
        FALLBACK, GO or SHARED, or None when the engine stopped meanwhile (the caller raises its
        failure)."""
        w, at = self._w, self._at + _REPLY
        started = None
        nudged = False
        while True:
            word = self._reply_word = w[at]     # (reply(), without its call)
            if word >> 3 == seq:
                return word & 7
            if not engine_alive():
                return None
            now = time.monotonic()
            if started is None:
                started = now
            elif now - started > NUDGE_S:
                if not nudged:
                    nudged = True
                    nudge()
                elif now - started > self._timeout:
                    raise CollectiveTimeoutError(
                        f"rank {self.rank}: rank 0 did not answer the shared-memory board "
                        f"about {name!r} within {self._timeout:g} s while its engine lived "
                        f"(HORA_TRANSPORT_TIMEOUT); is rank 0 stopped?")
            self.pause(started, now)

    # -- SHARED reductions, every rank ----------------------------------------------------------
    def reduce_shared(self, req, nbytes, out=None):
        """After SHARED (every rank's input of ``nbytes`` is in its slot): the reduction of the
        slots in rank order, postscaled, into ``out`` (a flat array of the request's dtype)
        or else into a buffer of this rank's, to copy out before its next board call.  Every
        rank computes the same bits, those of :meth:`partial` and :meth:`finish`."""
        if nbytes <= 8 and out is not None:
            scalar = self._scalar(req, nbytes)
            if scalar is not None:
                out[0] = self._fold_scalar(req, scalar, nbytes)
                self._shared += 1
                return out
        key = (req.dtype, nbytes, self._shared & 1)
        got = self._inputs.get(key)
        if got is None:             # every slot's input, and a buffer for the result
            if len(self._inputs) > 256:
                self._inputs.clear()
            views = [self._view(r, req.dtype, nbytes) for r in range(self.size)]
            got = self._inputs[key] = (views, np.empty_like(views[0]))
        views, buffer = got
        out = buffer if out is None else out
        fold(req, views, out)
        self.finish(req, out)
        self._shared += 1
        return out

    def _scalar(self, req, nbytes):
        """For an allreduce of one float32 or float64 element (``nbytes``), an op of
        _SCALAR_OPS and no prescale: ``(view of the segment, scratch number)`` of its dtype,
        the same on every rank (the signatures match); else None.

        A loss or a metric is such a number, and at a few microseconds a call the numpy calls
        of the general path (a copy into the slot, one ufunc per rank, the postscale: most
        of a microsecond each, more after another process had the CPU) are what a call
        costs.  Python's float arithmetic gives the same bits: a float64 sum is numpy's, and
        a float32 sum or product computed in float64 and rounded once to float32 (storing
        it in the float32 scratch) is the correctly rounded float32 result, as numpy's
        (float64 carries more than twice float32's precision plus two bits, so rounding
        twice is harmless)."""
        last, scalar = self._scalar_of
        if req is last:                 # (a blocking call's request is kept: Engine._quick)
            return scalar
        scalar = None
        if req.op in _SCALAR_OPS and req.prescale == 1:
            scalar = self._scalars.get(req.dtype)
            if scalar is not None and scalar[0].itemsize != nbytes:
                scalar = None
        self._scalar_of = (req, scalar)
        return scalar

    def _small_at(self, r):
        """The byte offset of slot ``r``'s small area of this SHARED round."""
        return self._small_area(r, self._shared & 1)

    def _small_area(self, r, area):
        """The byte offset of slot ``r``'s small area ``area`` (0 or 1)."""
        return self._slots + r * self._slot + _SIG_MAX + self._striped + area * self._small

    def _fold_scalar(self, req, scalar, nbytes):
        """:meth:`reduce_shared` of one number (:meth:`_scalar`): every slot's, in rank
        order, rounded to the dtype after each addition, then postscaled."""
        view, t, first, apart = scalar
        at = first[self._shared & 1]
        acc = add_up(view, t, at, apart[1:], view[at])
        if req.postscale != 1 or req.op == Average:     # (a Sum calls nothing more)
            acc = times(t, acc, self._factor(req))
        return acc

    # -- lanes: a blocking allreduce that a loop repeats, every rank --------------------------
    def lane(self, req, sig, nbytes, dtype, shape):
        """A :class:`Lane` for the blocking allreduce ``req`` (signature ``sig``, one array of
        ``nbytes``, its numpy ``dtype`` and ``shape``) when this board settles it without a
        prescale; else None.  The engine keeps it with the request (``Engine._quick``,
        ``Engine.lanes``), and each call then posts, stages and reduces through
        :meth:`lane_post` (:meth:`lane_answer` on rank 0) and :meth:`lane_fold` (SHARED) or
        :meth:`lane_stripe` (GO, from STRIPE_BYTES): what :meth:`post`,
        :meth:`reduce_shared` and :meth:`reduce_stripe` do, with every offset, view and
        choice made once.  Where the ranks outnumber the CPUs, a call's CPU time is what a
        round costs, twice over (two ranks take turns on each CPU), and those choices were a
        third of it; in a striped round of two ranks they were a third of the round.
        In a job on several hosts a worker posts the same way, and copies the host round's
        result from the result area (``result``); its leader plays the round
        (``Engine._lane_hosts``)."""
        if (req.kind != ALLREDUCE or not 0 < nbytes <= self.capacity
                or len(sig) > _SIG_MAX or req.prescale != 1):
            return None
        lane = Lane(req, sig, nbytes, dtype, shape)
        lane.hosts = len(self.leaders) > 1      # (whose capacity stops short of the stripes)
        lane.post = self._factor(req) if req.postscale != 1 or req.op == Average else 1.0
        if lane.post != 1 and nbytes > dtype.itemsize and dtype in (np.float32, np.float64):
            # the factor as scale() rounds it for these, which it multiplies by in place
            lane.mul = np.float32(lane.post) if dtype == np.float32 else lane.post
        if lane.hosts or nbytes >= STRIPE_BYTES:    # every rank copies the result area out
            lane.result = self._view(-1, dtype, nbytes)
        if nbytes >= STRIPE_BYTES:      # GO rounds: as stage() and reduce_stripe() choose
            n = nbytes // dtype.itemsize
            lo, hi = lane.stripe = self._stripe(n)
            lane.acc = lane.result[lo:hi]
            slots = [self._view(r, dtype, nbytes) for r in range(self.size)]
            lane.inputs = [v[lo:hi] for v in slots]
            own = slots[self.rank]
            lane.unstaged = nbytes >= _UNSTAGED_BYTES
            # (destination, first, end) of each part of the input the slot gets
            lane.mine = (tuple((own[i:j], i, j) for i, j in ((0, lo), (hi, n)) if j > i)
                         if lane.unstaged else ((own, 0, n),))
            return lane
        scalar = self._scalar(req, nbytes) if nbytes <= 8 else None
        if scalar is not None:
            lane.view, lane.t, lane.first, apart = scalar
            lane.mine = tuple(f + apart[self.rank] for f in lane.first)
            lane.inputs = apart[1:]
        else:
            lane.inputs = tuple([self._u8[off:off + nbytes].view(dtype)
                                 for off in (self._small_area(r, area) for r in range(self.size))]
                                for area in (0, 1))
            lane.mine = tuple(views[self.rank] for views in lane.inputs)
            fn = REDUCE[req.op]
            if self.size > 1 and nbytes > dtype.itemsize and fn in _POSITIONAL:
                # fold's steps for each area; more than one element: see fold
                lane.fold = fn
                lane.folds = tuple((v[0], v[1], tuple(v[2:])) for v in lane.inputs)
        return lane

    def lane_post(self, lane, a):
        """:meth:`post` of ``lane``'s input ``a`` (the array of its request)."""
        if lane.sig is not self._last_sig:
            self._write_sig(lane.sig)
        self.lane_stage(lane, a)
        return self._ring(lane.nbytes)

    def lane_caller(self, lane, engine, running):
        """A worker's call through ``lane`` (below STRIPE_BYTES), made once: a function
        ``call(a, inplace)`` that does what ``Engine.lane_now`` does with it in one frame
        and with every attribute it reads taken out beforehand: it takes the ``engine``'s
        board lock and marks the lane's name in flight, posts ``a`` (:meth:`lane_post`),
        waits for rank 0's answer (its first look inline, then :meth:`wait_reply`), after
        SHARED folds the slots (:meth:`lane_fold`; a Sum, Average or Product of more than
        one element inline) and after RESULT copies the host round's result out, counts
        the call as ``Engine.lane_now`` does (and, while the timeline records, the round as
        an ``ALLREDUCE board`` span) and returns the result (``a`` itself when ``inplace``).
        It returns None before it takes anything when the engine's state is not
        ``running``, another thread is on the board, the name is in flight, or an in-place
        ``a`` is not contiguous: the caller then takes the general path.  Whatever else
        rank 0 answers, and a failure, go on as ``Engine.lane_now`` does
        (``engine._lane_tail``, ``engine._board_broke``).

        Where the ranks outnumber the CPUs, each CPU's round is its ranks' calls in turn,
        so that every step of a call lengthens the round: the three frames of this call
        (``Engine.lane_now`` and the board's steps) were a seventh of a worker's call (its
        instructions, as callgrind counts them)."""
        lock, inflight, key = engine._board_lock, engine._queue.inflight, lane.key
        alive, nudge, name = engine._running, engine._nudge, lane.req.name
        sig, nbytes, flat, shape, named = lane.sig, lane.nbytes, lane.flat, lane.shape, lane.named
        view, result, traced = lane.view, lane.result, (name, ROUND, {"bytes": nbytes})
        rounds = [None, None]       # the timeline's recorder, and its list of the lane's rounds
        # where this rank's input goes in each area: an index of ``view``, or a view of the
        # lane's shape
        stages = lane.mine if view is not None or flat else tuple(
            m.reshape(shape) for m in lane.mine)
        fn, folds, mul = lane.fold, lane.folds, lane.mul
        if fn is not None and mul is None and lane.post != 1:
            fn = None                       # (lane_fold scales it)
        at = self._at
        w, nb_at, post_at, reply_at = self._w, at + _NBYTES, at + _POST, at + _REPLY
        crowded, fence, bell, rank = self._crowded, self._fence, self._bell, self.rank

        def call(a, inplace):
            rec = timeline._recorder
            if engine._state is not running:
                return None
            started = _now() if rec is not None else 0.0
            if not inplace:
                out = None                  # (made by the fold, or a copy of the result area)
            elif flat:
                out = a
            elif a.flags.c_contiguous:
                out = a.reshape(-1)
            else:
                return None
            if not lock.acquire(False):
                return None
            if inflight.setdefault(key, lane) is not lane:     # (see Engine.lane_now)
                lock.release()
                return None
            got = None
            try:
                if sig is not self._last_sig:
                    self._write_sig(sig)
                area = self._shared & 1
                if view is not None:        # (lane_stage's steps)
                    view[stages[area]] = a.item()
                else:
                    stages[area][...] = a
                w[nb_at] = nbytes           # (_ring's steps)
                seq = self._seq = self._seq + 1
                w[post_at] = seq
                if crowded:
                    w[_BELL] = (seq * 64 + rank) & 0xFFFFFFFF
                    fence.acquire()
                    fence.release()
                    if w[_ASLEEP]:
                        _wake(bell)
                word = self._reply_word = w[reply_at]   # (wait_reply's first look)
                got = word & 7 if word >> 3 == seq else self.wait_reply(seq, alive, nudge, name)
                if got == SHARED:
                    if fn is None:
                        out = self.lane_fold(lane, out)
                    else:                   # (lane_fold's steps)
                        self._shared += 1
                        first, second, rest = folds[area]
                        out = fn(first, second, out)
                        for x in rest:
                            fn(out, x, out)
                        if mul is not None:
                            np.multiply(out, mul, out)
                elif got == RESULT:         # (a host round: the result is in the result area)
                    out = copy_out(out, result)
            except (CollectiveTimeoutError, TransportBrokenError) as e:
                got = engine._board_broke(self, e)
            finally:
                if got == SHARED or got == RESULT:
                    inflight.pop(key, None)
                elif inflight.get(key) is lane:     # (not cleared by a failure meanwhile)
                    inflight[key] = object()
                lock.release()
            if got != SHARED and got != RESULT:
                return engine._lane_tail(lane, a, inplace, got)
            if rec is not None:         # (Recorder.rounds)
                if rounds[0] is not rec:
                    rounds[:] = rec, rec.rounds(traced)
                rounds[1] += (started, _now())
            c = stats.counters              # (count_reduced's counts, in stats.Counters' lane_*)
            c.lane_calls += 1
            c.lane_bytes += nbytes
            c.last_op = named
            c.plane = "board"
            return a if inplace else out if flat else out.reshape(shape)
        return call

    def lane_caller0(self, lane, engine, running, hint_s):
        """Rank 0's call through ``lane`` (one host, below STRIPE_BYTES), made once: what
        ``Engine.lane_now`` and ``Engine._lane_rank0`` do with it, in one frame, with the
        board's steps inline (:meth:`lane_stage`, :meth:`lane_answer` when every other rank
        has posted the lane's call, :meth:`lane_fold`) and every attribute it reads taken
        out beforehand, as :meth:`lane_caller` makes a worker's.  It returns None before it
        takes anything where ``Engine.lane_now`` does.  When a post is missing or is another
        call, or the engine is busy, it waits as ``Engine._lane_rank0`` does
        (``engine._lane_wait``, then ``engine._board_rank0``); another thread in a board
        call sends it to ``engine._lane_rank0`` whole.  ``hint_s``: how often a call tells
        the stall inspector that every rank came (``engine._hint``).

        Where the ranks outnumber the CPUs, the rank sharing rank 0's CPU gets as much of it
        as rank 0 takes, so that each microsecond of rank 0's call lengthens the round by
        about two (docs/performance-notes.md)."""
        lock, inflight, key = engine._board_lock, engine._queue.inflight, lane.key
        # (the pacer hands its list of unsent requests out and starts a new one: read anew)
        drive, queued, pacer = engine._drive, engine._queue.items, engine._pacer
        idle, clock, ex = engine._coord_idle, engine._clock, engine._exec
        nbytes, flat, shape, named = lane.nbytes, lane.flat, lane.shape, lane.named
        req, sig, traced = lane.req, lane.sig, (lane.req.name, ROUND, {"bytes": nbytes})
        rounds = [None, None]       # the timeline's recorder, and its list of the lane's rounds
        view = lane.view
        stages = lane.mine if view is not None or flat else tuple(
            m.reshape(shape) for m in lane.mine)
        fn, folds, mul = lane.fold, lane.folds, lane.mul
        if fn is not None and mul is None and lane.post != 1:
            fn = None                       # (lane_fold scales it)
        w, nxt, rows, crowded, fence = self._w, self._next, self._rows, self._crowded, self._fence

        def call(a, inplace):
            rec = timeline._recorder
            if engine._state is not running:
                return None
            started = _now() if rec is not None else 0.0
            if not inplace:
                out = None                  # (made by the fold)
            elif flat:
                out = a
            elif a.flags.c_contiguous:
                out = a.reshape(-1)
            else:
                return None
            if not lock.acquire(False):
                return None
            if inflight.setdefault(key, lane) is not lane:     # (see Engine.lane_now)
                lock.release()
                return None
            got = None
            try:
                if not drive.acquire(False):    # (another thread steps the engine)
                    got = engine._lane_rank0(lane, a, self)
                else:
                    engine._in_board = True
                    try:
                        area = self._shared & 1
                        if view is not None:    # (lane_stage's steps)
                            view[stages[area]] = a.item()
                        else:
                            stages[area][...] = a
                        got = SHARED
                        busy = not (engine._state is running and not ex.pending and not queued
                                    and not pacer.unsent and idle())    # (Engine._busy)
                        if busy or not (lane.epoch == self._epoch
                                        and self._post_col == self._next_col
                                        and self._sigver_col == lane.vers
                                        or self._lane_open(lane)):
                            if (busy or self.missing is None
                                    or not engine._lane_wait(lane, self, SHARED)):
                                got = engine._board_rank0(req, [a], self, sig, nbytes, True)
                                if got is not SHARED and got is not GO:
                                    got = got[0]
                        else:                   # (lane_answer's steps: every post is in)
                            for r, at in rows:
                                seq = nxt[r]
                                w[at + _REPLY] = seq * 8 + SHARED
                                nxt[r] = seq + 1
                            seen = self._seen
                            if seen:
                                for r, _ in rows:
                                    seen.pop(r, None)
                            if crowded:
                                fence.acquire()
                                fence.release()
                                if self._asleep_col != self._awake:
                                    for r, at in rows:
                                        if w[at + _ASLEEP]:
                                            _wake(self._ptr(at + _REPLY))
                                os.sched_yield()
                            # (rank 0 came last: _count_wait, in fewer steps)
                            stats.counters.lane_unwaited += 1
                            now = clock()
                            if now - engine._hinted > hint_s:
                                engine._hint(now)
                        if engine._held_back:   # (see Engine._heard_rounds)
                            engine._held_back = False
                            engine._stepped_to_end()
                    finally:
                        engine._in_board = False
                        drive.release()
                if got == SHARED:
                    if fn is None:
                        out = self.lane_fold(lane, out)
                    else:                   # (lane_fold's steps)
                        area = self._shared & 1
                        self._shared += 1
                        first, second, rest = folds[area]
                        out = fn(first, second, out)
                        for x in rest:
                            fn(out, x, out)
                        if mul is not None:
                            np.multiply(out, mul, out)
                elif got == RESULT:
                    out = copy_out(out, lane.result)
            except (CollectiveTimeoutError, TransportBrokenError) as e:
                got = engine._board_broke(self, e)
            finally:
                if got == SHARED or got == RESULT:
                    inflight.pop(key, None)
                elif inflight.get(key) is lane:     # (not cleared by a failure meanwhile)
                    inflight[key] = object()
                lock.release()
            if got != SHARED and got != RESULT:
                return engine._lane_tail(lane, a, inplace, got)
            if rec is not None:         # (Recorder.rounds)
                if rounds[0] is not rec:
                    rounds[:] = rec, rec.rounds(traced)
                rounds[1] += (started, _now())
            c = stats.counters              # (count_reduced's counts, in stats.Counters' lane_*)
            c.lane_calls += 1
            c.lane_bytes += nbytes
            c.last_op = named
            c.plane = "board"
            return a if inplace else out if flat else out.reshape(shape)
        return call

    def lane_stage(self, lane, a):
        """:meth:`stage` of ``lane``'s input ``a``: into this rank's slot, this round's area
        (of a striped lane: the parts the other ranks reduce; ``a`` is contiguous)."""
        if lane.stripe is not None:
            flat = a.reshape(-1)
            for dst, i, j in lane.mine:
                np.copyto(dst, flat[i:j])
            return
        mine = lane.mine[self._shared & 1]
        if lane.view is not None:       # (item(): the value as a Python float, exactly)
            lane.view[mine] = a.item()
        else:
            # (``a`` has the lane's dtype and shape: an assignment, 80 ns cheaper than copyto)
            (mine if lane.flat else mine.reshape(lane.shape))[...] = a

    def lane_answer(self, lane, what):
        """Rank 0, its input staged (:meth:`lane_stage`): when every other rank's open post
        is ``lane``'s collective (:meth:`_lane_open`), answer each with ``what``, SHARED or
        GO, as :meth:`share` or :meth:`go` do, and return True; else answer nothing and
        return False (:attr:`missing` says why).  No dict: rank 0's share of a round is what
        a crowded host's round takes, twice over (the other rank on its CPU gets as much
        CPU, which it spends yielding)."""
        if not (lane.epoch == self._epoch and self._post_col == self._next_col
                and self._sigver_col == lane.vers) and not self._lane_open(lane):
            return False                # (_lane_open's first look, inline)
        w, nxt, rows = self._w, self._next, self._rows
        for r, at in rows:
            seq = nxt[r]
            w[at + _REPLY] = seq * 8 + what
            nxt[r] = seq + 1
        seen = self._seen
        if seen:
            for r, _ in rows:
                seen.pop(r, None)
        if self._crowded:               # (answer_all's wake-ups, and share()'s yield)
            fence = self._fence
            fence.acquire()
            fence.release()
            if self._asleep_col != self._awake:
                for r, at in rows:
                    if w[at + _ASLEEP]:
                        _wake(self._ptr(at + _REPLY))
            if what == SHARED:
                os.sched_yield()
        return True

    def lane_posts(self, lane):
        """Rank 0: ``{rank: seq}`` of every other rank's open post when each is ``lane``'s
        collective, else None (:meth:`_lane_open`)."""
        if not self._lane_open(lane):
            return None
        nxt = self._next
        return {r: nxt[r] for r, _ in self._rows}

    def _lane_open(self, lane):
        """Rank 0: whether every other rank's open post is ``lane``'s collective (as
        :meth:`open_posts` and :meth:`matches` find: its signature, which fixes an
        allreduce's bytes, in its slot), their sequence numbers those of ``_next``; else
        :attr:`missing` is a rank yet to post, or None when a post is another collective's
        (or to be read in full: :meth:`matches`)."""
        if lane.epoch != self._epoch:   # (a signature read since: which are the lane's)
            vers = array.array("Q", [v if s == lane.sig else _NEVER for v, s in self._known])
            lane.vers, lane.epoch = memoryview(vers)[1:], self._epoch
        if self._post_col == self._next_col and self._sigver_col == lane.vers:
            return True
        w, nxt, vers = self._w, self._next, lane.vers
        for r, at in self._rows:        # (which rank, in rank order; or a post since)
            seq = w[at + _POST]
            if seq < nxt[r]:
                self.missing = r
                return False
            if seq != nxt[r] or w[at + _SIGVER] != vers[r - 1]:
                self.missing = None
                return False
        return True

    def lane_fold(self, lane, out):
        """:meth:`reduce_shared` of ``lane``'s inputs into ``out`` (None: a new flat array),
        returned."""
        area = self._shared & 1
        self._shared += 1
        view = lane.view
        if view is not None:
            at = lane.first[area]
            acc = add_up(view, lane.t, at, lane.inputs, view[at])
            if lane.post != 1:
                acc = times(lane.t, acc, lane.post)
            if out is None:
                out = np.empty(1, lane.dtype)
            out[0] = acc
            return out
        fn = lane.fold
        if fn is not None:      # (fold's steps, made once; the ufunc allocates ``out``)
            first, second, rest = lane.folds[area]
            out = fn(first, second, out)
            for x in rest:
                fn(out, x, out)
        else:
            if out is None:
                out = np.empty(lane.nbytes // lane.dtype.itemsize, lane.dtype)
            fold(lane.req, lane.inputs[area], out)
        if lane.mul is not None:    # (scale()'s product, without its choices)
            np.multiply(out, lane.mul, out)
        elif lane.post != 1:
            scale(out, lane.post, 1)
        return out

    def copy_shared(self, req, nbytes):
        """After SHARED of a broadcast (its root's input of ``nbytes`` is in the root's
        slot): a copy of it, flat, this rank's to keep."""
        out = self._view(req.root, req.dtype, nbytes).copy()
        self._shared += 1
        return out

    def gathered(self, req):
        """After SHARED of an allgather (every rank's input is in its slot, its bytes in its
        row): every input in rank order, flat, this rank's to keep.  (A rank posting its
        next call meanwhile writes the other area's count.)"""
        w, at = self._w, _GATHERED + (self._shared & 1)
        sizes = tuple(w[r * _ROW + at] for r in range(self.size))
        key = (req.dtype, sizes, self._shared & 1)
        views = self._inputs.get(key)
        if views is None:
            if len(self._inputs) > 256:
                self._inputs.clear()
            views = self._inputs[key] = [self._view(r, req.dtype, nbytes)
                                         for r, nbytes in enumerate(sizes)]
        self._shared += 1
        return np.concatenate(views)

    # -- striped reductions (GO), every rank ----------------------------------------------------
    def reduce_stripe(self, req, nbytes):
        """This rank's stripe of the result: every slot's elements there, in rank order (one
        rank computes each element, so every rank reads the same bits); then says so."""
        lo, hi = self._stripe(nbytes // np.dtype(req.dtype).itemsize)
        self._round += 1
        if hi > lo:
            acc = self._view(-1, req.dtype, nbytes)[lo:hi]
            inputs = [self._view(r, req.dtype, nbytes)[lo:hi] for r in range(self.size)]
            if self._mine is not None:      # (stage left it out of the slot)
                inputs[self.rank] = self._mine[lo:hi]
            fold(req, inputs, acc)
            self.finish(req, acc)
        self._mine = None
        self._stripe_done()

    def lane_stripe(self, lane, a):
        """:meth:`reduce_stripe` of ``lane``'s input ``a`` (after GO on a striped lane)."""
        self._round += 1
        acc = lane.acc
        if acc.size:
            inputs = lane.inputs
            if lane.unstaged:           # (lane_stage left this rank's stripe out of the slot)
                inputs = inputs.copy()
                lo, hi = lane.stripe
                inputs[self.rank] = a.reshape(-1)[lo:hi]
            fold(lane.req, inputs, acc)
            if lane.post != 1:
                scale(acc, lane.post, 1)
        self._stripe_done()

    def _stripe_done(self):
        """Say that this rank reduced its stripe of this round."""
        self._w[self._at + _DONE] = self._round
        if self._crowded:
            self._w[_DONE_BELL] = (self._round * 64 + self.rank) & 0xFFFFFFFF
            self._rouse(None, self._word(0, _DONE_BELL), self.size)

    def _stripe(self, n):
        """This rank's stripe ``(lo, hi)`` of a striped input of ``n`` elements: whole cache
        lines."""
        per = -(-n // self.size // 16) * 16
        return min(n, self.rank * per), min(n, (self.rank + 1) * per)

    def wait_stripes(self, engine_alive, name):
        """Wait until every rank has reduced its stripe of this round (of the collective
        ``name``); False when the engine stopped meanwhile (a peer died: the caller raises the
        engine's failure)."""
        hdr, want, started = self._hdr, self._round, time.monotonic()
        done = hdr[:, _DONE]
        while True:
            bell = self._w[_DONE_BELL] & 0xFFFFFFFF
            if (done >= want).all():
                return True
            if not engine_alive():
                return False
            waited = time.monotonic() - started
            if waited > self._timeout:
                late = [r for r in range(self.size) if done[r] < want]
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: rank(s) {late} did not reduce their stripes of "
                    f"{name!r} on the shared-memory board within {self._timeout:g} s while "
                    f"their engines lived (HORA_TRANSPORT_TIMEOUT); are they stopped?")
            if self._crowded:
                if waited < self._spin_s:
                    os.sched_yield()
                else:
                    self._sleep(self._word(0, _DONE_BELL), bell)
            elif waited > self._spin_s:
                time.sleep(50e-6)

    def result(self, dtype, nbytes):
        """The last result, a flat array of ``dtype`` (a view into the board: copy it out
        before posting again)."""
        return self._view(-1, dtype, nbytes)

    # -- rank 0 -------------------------------------------------------------------------------
    def open_posts(self):
        """``{rank: seq}`` of the posts rank 0 has not answered; :attr:`missing` becomes the
        lowest rank without one (None: every rank posted)."""
        w, nxt = self._w, self._next
        out = {}
        missing = None
        for r in range(1, self.size):
            seq = w[r * _ROW + _POST]
            if seq >= nxt[r]:
                out[r] = seq
            elif missing is None:
                missing = r
        self.missing = missing
        return out

    def answer_all(self, posts, what):
        """Answer each post of ``posts`` (``{rank: seq}``) with ``what``; then, on a crowded
        host, wake those of the ranks that sleep (one fence for all the answers)."""
        w, nxt, seen = self._w, self._next, self._seen
        for r, seq in posts.items():
            nxt[r] = seq + 1
            if seen:
                seen.pop(r, None)
            w[r * _ROW + _REPLY] = seq * 8 + what
        if self._crowded and posts:
            fence = self._fence         # (_fence(), without its call)
            fence.acquire()
            fence.release()
            for r in posts:
                if w[r * _ROW + _ASLEEP]:
                    _wake(self._word(r, _REPLY))

    def release(self, posts):
        """A barrier: every rank has come."""
        self.answer_all(posts, RESULT)

    def go(self, posts):
        """Every rank reduces its stripe now (the posts matched)."""
        self.answer_all(posts, GO)

    def share(self, posts):
        """Every rank reduces every input itself now (the posts matched, and rank 0 staged its
        input): :meth:`reduce_shared`."""
        self.answer_all(posts, SHARED)
        if self._crowded:   # let a rank sharing this CPU take its answer (and post its
            os.sched_yield()    # next call) before this one: the last to post decides it

    def fall_back(self, posts):
        self.answer_all(posts, FALLBACK)

    def serve(self, busy, clock):
        """Rank 0, outside a board call of its own (every engine step: asks nothing more
        while no post is open): send the open posts to the engine when rank 0 is ``busy()``
        (collectives pending, requests at the coordinator, leaving) or when they waited
        :data:`PATIENCE_S` by ``clock()``."""
        posts = self.open_posts()
        if not posts:
            return
        busy, now = busy(), clock()
        self.answer_all({r: seq for r, seq in posts.items()
                         if busy or waited(self._seen, r, seq, now) >= PATIENCE_S}, FALLBACK)

    def matches(self, posts, sig, nbytes):
        """Whether every open post in ``posts`` (every rank's) is the collective ``sig`` of
        ``nbytes`` (None: any number; an allgather's ranks may bring different ones)."""
        w, known = self._w, self._known
        for r in posts:
            if nbytes is not None and w[r * _ROW + _NBYTES] != nbytes:
                return False
            version = w[r * _ROW + _SIGVER]
            if known[r][0] != version:      # a new signature there: read it once
                off = self._slots + r * self._slot
                length = w[r * _ROW + _SIGLEN]
                known[r] = (version, self._u8[off:off + length].tobytes())
                self._epoch += 1
            if known[r][1] != sig:
                return False
        return True

    def partial(self, req, arrays, nbytes):
        """This board's part of the reduction (rank 0's input, ``arrays`` times the prescale
        factor, and every slot's, in rank order), as the bytes a :class:`HostPost` carries;
        :meth:`combine` adds the hosts' parts.  One float number summed or averaged is added
        up in Python floats, as :meth:`reduce_shared` does (see :meth:`_scalar`)."""
        if nbytes <= 8 and len(arrays) == 1:
            scalar = self._scalar(req, nbytes)
            if scalar is not None:
                view, t, first, apart = scalar
                # (item(): the dtype's value, exactly)
                t[0] = add_up(view, t, first[self._shared & 1], apart[1:], arrays[0].item())
                return t.tobytes()
        key = (req.dtype, nbytes, self._shared & 1)
        views = self._partials.get(key)
        if views is None:
            if len(self._partials) > 256:
                self._partials.clear()
            views = self._partials[key] = [self._view(r, req.dtype, nbytes)
                                           for r in (-1, *range(1, self.size))]
        acc = views[0]
        pack(acc, arrays)
        if req.prescale != 1:
            scale(acc, req.prescale, 1)
        if self.size > 1:           # (a host of one rank: its input is the host's part)
            fold(req, views, acc)
        return acc.tobytes()

    def combine(self, req, parts, nbytes):
        """The hosts' parts ``parts`` (:meth:`partial`'s bytes, from every host's board)
        reduced in host order and postscaled, into the result area (returned, flat): the
        same bits on every host."""
        out = self._view(-1, req.dtype, nbytes)
        scalar = self._scalar(req, nbytes) if nbytes <= 8 else None
        if scalar is None:
            arrays = [np.frombuffer(p, out.dtype) for p in parts]
            if len(arrays) > 1:
                fold(req, arrays, out)
            else:
                np.copyto(out, arrays[0])
            self.finish(req, out)
            return out
        view, t, _, _ = scalar
        fmt = t.format
        acc = memoryview(parts[0]).cast(fmt)[0]
        for p in parts[1:]:
            t[0] = acc + memoryview(p).cast(fmt)[0]
            acc = t[0]
        if req.postscale != 1 or req.op == Average:
            acc = times(t, acc, self._factor(req))
        view[self._result // t.itemsize] = acc
        return out

    def finish(self, req, acc):
        """The postscale of the reduction ``acc`` (an Average divides by the job's size)."""
        if req.postscale != 1 or req.op == Average:
            scale(acc, self._factor(req), 1)

    def _factor(self, req):
        """The one factor of ``req``'s postscale and, for an Average, the division by the
        job's size, combined as :func:`scale` combines them."""
        return float(req.postscale) / (self.job_size if req.op == Average else 1)


class Lane:
    """What :meth:`Board.lane` makes once for a repeated blocking allreduce: the request and
    its ``op``, its signature, bytes, numpy dtype and shape (``flat``: 1-d), its name's key
    in flight, ``named`` (the call as ``stats.counters.last_op`` names it), the postscale
    factor (1: none; ``mul``, that factor as :func:`scale` rounds it, for more than one
    float32 or float64), and where this rank's input goes in each of the two small areas
    (``mine``).  One number in Python floats: ``view`` and ``t`` (see
    :meth:`Board._scalar`), ``mine`` and ``first`` as indices of ``view``, ``inputs`` the
    other slots' distances from slot 0; numpy: ``view`` None, ``mine`` this rank's views,
    ``inputs`` every slot's views, for each area, and for a Sum, an Average or a Product of
    more than one element, its ufunc (``fold``) and each area's views as ``(first, second,
    the rest)`` (``folds``).
    ``result``: on a board of host rounds, the result area as a flat array of
    ``dtype`` (None on one host).  ``hosts``: the board plays host rounds.  On rank 0,
    ``vers``: each other rank's version of the lane's signature in its slot, as rank 0
    last read them (``Board._epoch`` then: ``epoch``), :data:`_NEVER` where the slot held
    another collective's.

    A striped lane (from STRIPE_BYTES, one host: GO rounds) has ``stripe``, this rank's
    ``(lo, hi)``; ``acc`` and ``result``, its stripe of the result area and the whole of it;
    ``inputs``, every slot's stripe; ``unstaged``, whether this rank's stripe is read from
    the caller's array instead of its slot; and ``mine``, the parts of the input that go
    into the slot, as ``(destination, first, end)``."""

    __slots__ = ("req", "op", "sig", "nbytes", "dtype", "shape", "flat", "key", "named", "post",
                 "view", "t", "mine", "first", "inputs", "result", "hosts", "stripe", "acc",
                 "unstaged", "mul", "fold", "folds", "vers", "epoch", "call", "postscale")

    def __init__(self, req, sig, nbytes, dtype, shape):
        self.req, self.sig, self.nbytes, self.dtype, self.shape = req, sig, nbytes, dtype, shape
        self.op, self.flat = req.op, len(shape) == 1
        self.postscale = req.postscale      # (ops._repeated compares a call's with it)
        self.key = (req.process_set, req.name)
        self.named = ("allreduce", req.name)    # (as stats.Counters' last_op)
        self.post = 1.0
        self.mul = self.fold = self.folds = None
        self.view = self.t = self.mine = self.first = self.inputs = self.result = None
        self.stripe = self.acc = self.vers = None
        self.hosts = self.unstaged = False
        self.epoch = -1
        self.call = None


def waited(seen, r, seq, now):
    """How long rank ``r``'s open post ``seq`` has waited at ``now``, counted from when it
    was first seen (``seen``: ``{r: (seq, when first seen)}``, updated here)."""
    first = seen.get(r)
    if first is None or first[0] != seq:
        seen[r] = first = (seq, now)
    return now - first[1]
