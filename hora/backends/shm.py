"""Shared-memory collectives among the ranks of one host.

The ranks map one segment of ``/dev/shm``: two *sets* (double buffering) of one slot per
rank.  A buffer goes through in chunks of at most a slot.  For an allreduce, each rank
copies its chunk into its own slot, except its own sub-range (rank r's is the r-th of N);
after a barrier, rank r reduces its sub-range, in its own buffer, with every other slot's,
and publishes the result in its slot (one rank computes each element, so every rank reads
the same bits); after a second barrier every rank copies the other sub-ranges out.  Memory
traffic per rank is under 3x the buffer, against 2(N-1)/N x the buffer *through the kernel*
for the TCP ring, which is why shm is several times faster on one host.

Chunks alternate between the two sets, and every chunk's writes are separated from the
next writes into the same set by a barrier that every rank reaches only after reading it,
so no rank ever overwrites data another still needs.  That holds across collectives too.
An allreduce needs one barrier per chunk (and one at the end): a chunk's results are copied
out after the *next* chunk's barrier.  Meanwhile a rank may already write its inputs for
the chunk after that into the same set, which is safe because sub-ranges sit at the same
place in every chunk: inputs go outside the writer's own sub-range, results inside it.
A reduce-scatter stages its chunks the same way (a rank's own block stays in its buffer and
is reduced there), and needs no copy out: one barrier per chunk.

Where the kernel lets a host's ranks read each other's memory (:mod:`hora.backends.cma`,
probed once on every rank), a collective of at least 8 MiB skips the segment: each rank
publishes its buffer's address in its barrier line, and after the barrier every rank reads
what it needs straight from the others' buffers, one copy instead of two.  A reduce-scatter
reads the others' inputs of its block a part at a time and reduces each part while it is in
the caches (own input first, then the others in rank order, as through the segment); an
allgather reads every other block; an allreduce does both (its blocks are then the whole
buffer's, not each chunk's: with 3 ranks or more, a result's last bits may differ from the
segment's; every rank still gets the same bits).  An owner must leave its buffer alone until
the others have read it, so such a call ends with a barrier, unless the caller (the
hierarchical plane, piece after piece) knows that its next barrier in the group comes after
the reads.  Below 8 MiB the two copies through the segment, which stay in the caches, cost
less than the kernel's work per page (reduce-scatters at N = 2, the segment against reads:
16 MiB 13.8 against 10.3 ms, 1 MiB 0.48 against 0.56 ms; docs/performance-notes.md).

Barriers go through words at the head of the segment, one cache line per rank: a rank
writes how many barriers it has reached, then polls the others' counts, yielding its CPU
between looks where the ranks outnumber the CPUs.  Past its spin budget (``spin_s``) it
sleeps on a *bell* word that every arriving rank changes, waking the sleepers
(:mod:`hora.backends.futex`).  Every millisecond of waiting it also asks the transport
whether a peer hung up, so a rank killed while others wait in a barrier is named as quickly
as over TCP, and a peer that makes no progress for the transport's timeout (a stopped rank)
fails the wait with :class:`~hora.errors.CollectiveTimeoutError`.  The words are plain
loads and stores: a rank's writes into its slot are seen before its count, and its reads of
the others' slots come after it saw their counts, because x86-64 keeps stores in order and
loads in order.  Elsewhere (and before the first segment exists) a barrier is a one-byte
exchange over the job's TCP transport, whose socket calls order the memory accesses on
every architecture.  Over TCP a barrier costs a round trip through the kernel (20-30 us
with the threads' hand-offs); through the words, a few microseconds.

The segment is made, mapped on every rank and unlinked by
:func:`hora.backends.segments.shared_segment`.

Layer: backends.  Knows nothing of names or requests.
"""
import ctypes
import errno
import logging
import os
import time

import numpy as np

from ..errors import CollectiveTimeoutError, HoraError, HoraInternalError, TransportBrokenError
from . import cma, futex
from .ring import even_counts, segment_bounds
from .segments import SEGMENT_PREFIX, remove_segments_of, shared_segment, shm_bytes, vote

__all__ = ["ShmGroup", "SEGMENT_PREFIX", "remove_segments_of", "shared_segment", "shm_bytes",
           "vote"]

log = logging.getLogger(__name__)

_ALIGN = 4096
_LINE_WORDS = 8             # int64 words per barrier line (64 bytes): one per rank, a bell
_COUNT, _ASLEEP = 0, 1      # a rank's line: barriers reached; it sleeps on the bell
# a rank's line, when the ranks read each other's memory (cma): its pid, whether it can read
# the others', the address of its buffer in a reduce-scatter and in an allgather (two
# words: a rank may publish the next reduce-scatter's while another still reads an
# allgather), and a random number its probe word holds
_PID, _CMA_OK, _RS_ADDR, _AG_ADDR, _NONCE = 2, 3, 4, 5, 6
_CMA_BYTES = 8 << 20        # collectives of buffers this large read from their owners
_CMA_PART = 1 << 20         # a reduce-scatter reads this many bytes of a peer at a time
_WATCH_S = 1e-3             # a barrier waiting this long asks the transport for hang-ups
_LOST_S = 3.0               # a read of a buffer that is gone looks this long for a lost rank
_NAP = futex.nap(_WATCH_S)  # and sleeps at most this long at a time past its spin budget


class ShmGroup:
    """Collectives through shared memory among every rank of transport ``t`` (all on one
    host): a :class:`~hora.backends.base.Plane`.

    Args:
        t: a connected :class:`~hora.backends.base.Transport` among these ranks; its
            barriers ride on it (``exchange``), spinning through its ``policy``.
        slot_bytes: the largest chunk one rank puts in the segment at a time.
        fallback: True: a set-up that fails declines (returns False); False: it raises.
        cma_reads: large reduce-scatters and allgathers may read the other ranks' buffers
            directly, where the kernel allows it on every rank (``HORA_SHM_CMA``).
    """

    name = "shm"      # how the timeline and the metrics call this plane

    def __init__(self, t, slot_bytes=4 << 20, fallback=True, cma_reads=True):
        self._t = t
        self._fallback = fallback      # False: a failed set-up raises instead of returning False
        self.spin_s = 0.0              # a barrier polls without sleeping this long (see tcp)
        self.rank, self.size = t.rank, t.size
        self._max_slot = max(_ALIGN, slot_bytes - slot_bytes % _ALIGN)
        self._slot = 0                 # current slot size in bytes (0: no segment yet)
        self._map = None
        self._set = 0                  # the set the next chunk uses
        self._count = 0                # segments made so far (part of the name)
        # the barrier words: a line per rank, then the bell's (see barrier())
        self._head = -(-(self.size + 1) * _LINE_WORDS * 8 // _ALIGN) * _ALIGN
        self._bell = self.size * _LINE_WORDS
        self._words = None             # the segment's barrier words (memoryview of int64)
        self._bell_addr = None         # the bell's address, for the futex calls
        self._passed = 0               # barriers this rank passed in the current segment
        self._pids = None              # every rank's pid, when they read each other's memory
        self._cma_wanted = cma_reads and cma.available()
        self._cma = None               # whether the ranks read each other (None: not asked)
        self._part = None              # where a reduce-scatter reads a peer's part (cma)
        self.usable = True             # False once set-up failed: callers use TCP instead

    # -- set-up ---------------------------------------------------------------------------
    def _ensure(self, nbytes):
        """Make slots of at least ``min(nbytes, max slot)`` bytes (collective: every rank
        calls it with the same value).  False when shared memory is unavailable."""
        want = min(self._max_slot, max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN))
        if want <= self._slot:
            return True
        if not self.usable:
            return False
        want = max(want, min(self._max_slot, 2 * self._slot))
        total = self._head + 2 * self.size * want
        ok, mapping = self._setup(total)
        if not ok:
            self.usable = False
            if not self._fallback:
                raise HoraError(f"rank {self.rank}: could not grow the shared-memory segment "
                                f"to {total} bytes (is /dev/shm full?); set HORA_BACKEND=tcp "
                                f"or HORA_SHM_SLOT_BYTES lower")
            return False
        self._words = None             # (an export of the old mapping: close() refuses)
        if self._map is not None:
            self._map.close()
        self._map, self._slot, self._set = mapping, want, 0
        # a new segment is zeroed on every rank alike: its barriers count from 0 again
        self._passed = 0
        if futex.available():
            self._words = memoryview(mapping)[:self._head].cast("q")
            base = np.frombuffer(mapping, dtype=np.uint8, count=1).ctypes.data
            self._bell_addr = futex.address(base, 8 * self._bell)
        return True

    def try_setup(self):
        """Collective: make a first, small segment now; False if shared memory is unusable."""
        fallback, self._fallback = self._fallback, True
        try:
            return self._ensure(_ALIGN)
        finally:
            self._fallback = fallback

    def _setup(self, total):
        self._count += 1
        mapping = shared_segment(self._t, total, str(self._count))
        return mapping is not None, mapping

    def barrier(self):
        """Every rank of the group has reached this barrier: through the segment's words,
        or over the transport where they are not used (see the module's docstring).

        A rank writes its count, then a new value into the bell, and wakes the ranks that
        sleep on the bell (:mod:`hora.backends.futex`)."""
        words = self._words
        if words is None:
            if self.spin_s > 0:         # the peers are a memory-bound copy away: do not sleep
                policy = self._t.policy
                policy.spin_until = max(policy.spin_until, time.monotonic() + self.spin_s)
            vote(self._t, True)
            return
        self._passed += 1
        k = self._passed
        futex.fence()       # (also orders the data's stores, should a copy have streamed them)
        words[self.rank * _LINE_WORDS + _COUNT] = k
        words[self._bell] = (k * self.size + self.rank) & 0xFFFFFFFF
        futex.fence()
        lines = range(0, self.size * _LINE_WORDS, _LINE_WORDS)
        if any(words[at + _ASLEEP] for at in lines):
            futex.wake(self._bell_addr, self.size)
        for at in lines:
            if words[at] < k:
                break
        else:
            return
        self._wait_words(words, lines, k)

    def _wait_words(self, words, lines, k):
        """Poll the barrier words (``lines``: each rank's) until every count reaches ``k``:
        for ``spin_s`` (yielding the CPU between looks where crowded), then sleeping on the
        bell; every _WATCH_S it asks the transport for hang-ups, and no rank arriving for
        the transport's timeout fails."""
        t = self._t
        crowded = t.policy.crowded
        timeout = getattr(t, "timeout", 300.0)
        mine = self.rank * _LINE_WORDS + _ASLEEP
        started = watched = progress = time.monotonic()
        waiting = len(lines)
        while True:
            rung = words[self._bell]    # before the counts: a later arrival changes it
            late = [at // _LINE_WORDS for at in lines if words[at] < k]
            if not late:
                return
            now = time.monotonic()
            if len(late) < waiting:
                waiting, progress = len(late), now
            if now - watched >= _WATCH_S:
                watched = now
                t.watch(timeout=0)      # raises TransportBrokenError naming a hung-up peer
                if now - progress > timeout:
                    named = [self._job_rank(p) for p in late]
                    me = self._job_rank(self.rank)
                    raise CollectiveTimeoutError(
                        f"rank {me}: no progress for {timeout:g} s waiting for ranks "
                        f"{named} at a shared-memory barrier")
            if now - started < self.spin_s:
                if crowded:
                    os.sched_yield()
                continue
            words[mine] = 1
            futex.sleep_on(self._bell_addr, rung, _NAP)
            words[mine] = 0

    def _job_rank(self, p):
        """Member ``p``'s rank in the job, for messages (a host's group of a job on several
        hosts maps its members to the job's ranks)."""
        members = getattr(self._t, "members", None)
        return members[p] if members else p

    def close(self):
        self._words = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass                    # a view is still alive: the GC unmaps it later
            self._map = None

    # -- views ----------------------------------------------------------------------------
    def _slots(self, dtype):
        """The current set's slots as ``size`` arrays of ``dtype``; then flips the set."""
        base = self._head + self._set * self.size * self._slot
        n = self._slot // dtype.itemsize
        whole = np.frombuffer(self._map, dtype=np.uint8, count=self.size * self._slot,
                              offset=base)
        self._set ^= 1
        return [whole[p * self._slot:p * self._slot + n * dtype.itemsize].view(dtype)
                for p in range(self.size)]

    def _area(self, dtype):
        """The current set as one array of ``dtype`` (size x slot bytes); flips the set."""
        base = self._head + self._set * self.size * self._slot
        n = self.size * self._slot // dtype.itemsize
        self._set ^= 1
        return np.frombuffer(self._map, dtype=dtype, count=n, offset=base)

    # -- collectives (flat, contiguous arrays; every rank calls with the same sizes) ------
    def allreduce(self, flat, reduce_fn):
        """Reduce ``flat`` in place over every rank.  False if shm is unusable (nothing
        was done; use another backend).  From :data:`_CMA_BYTES`, where the ranks may read
        each other's memory: a reduce-scatter and an allgather that read it (see the
        module's docstring)."""
        if self.size == 1 or flat.size == 0:
            return True
        if self._reads(flat):         # a reduce-scatter, then an allgather, both read
            counts = even_counts(flat.size, self.size)
            self._reduce_blocks(flat, counts, reduce_fn, False)
            self._read_blocks(flat, counts, True)
            return True
        if not self._ensure(flat.nbytes):
            return False
        r, n = self.rank, self.size
        per = self._slot // flat.itemsize
        # one layout for every chunk (a short last chunk is cut): rank p's sub-range sits at
        # the same place in every chunk, which the single barrier per chunk relies on
        bounds = segment_bounds(even_counts(per, n))
        previous = None
        for start in range(0, flat.size, per):
            count = min(per, flat.size - start)
            slots = [s[:count] for s in self._slots(flat.dtype)]
            chunk = flat[start:start + count]
            ranges = [(min(bounds[p], count), min(bounds[p + 1], count)) for p in range(n)]
            lo, hi = ranges[r]
            # the others need my input outside my sub-range only; mine stays where it is
            slots[r][:lo] = chunk[:lo]
            slots[r][hi:] = chunk[hi:]
            # after this barrier: every input of this chunk, and every result of the last one
            self.barrier()
            if previous is not None:
                _gather_results(*previous, r)
            if hi > lo:
                mine = chunk[lo:hi]
                _reduce_into(mine, [s[lo:hi] for s in slots], r, reduce_fn)
                slots[r][lo:hi] = mine
            previous = (chunk, slots, ranges)
        self.barrier()
        _gather_results(*previous, r)
        return True

    def reducescatter(self, flat, counts, reduce_fn, finish=True):
        """Afterwards rank r's block (``counts``) of ``flat`` holds the reduction over every
        rank; the rest of ``flat`` is unspecified.  False if shm is unusable.

        As in :meth:`allgather`, large buffers are read from the other ranks' ``flat`` where
        the ranks may read each other's memory (a part at a time, each reduced in while it
        is in the caches), and ``finish`` (False) leaves the last barrier to the caller."""
        if self.size == 1 or flat.size == 0:
            return True
        if self._reads(flat):
            self._reduce_blocks(flat, counts, reduce_fn, finish)
            return True
        if not self._ensure(flat.nbytes):
            return False
        r = self.rank
        bounds = segment_bounds(counts)
        mine_lo, mine_hi = bounds[r], bounds[r + 1]
        per = self._slot // flat.itemsize
        for start in range(0, flat.size, per):
            count = min(per, flat.size - start)
            slots = [s[:count] for s in self._slots(flat.dtype)]
            chunk = flat[start:start + count]
            lo, hi = max(mine_lo, start) - start, min(mine_hi, start + count) - start
            if hi > lo:     # the others need my input outside my block; mine stays in place
                slots[r][:lo] = chunk[:lo]
                slots[r][hi:] = chunk[hi:]
            else:
                slots[r][...] = chunk
            self.barrier()
            if hi > lo:
                _reduce_into(chunk[lo:hi], [s[lo:hi] for s in slots], r, reduce_fn)
        return True

    def allgather(self, out, counts, finish=True):
        """Fill every rank's block (``counts``) of ``out`` from its owner.  False if shm is
        unusable.

        From :data:`_CMA_BYTES` the blocks are read straight from their owners' ``out``
        (:mod:`hora.backends.cma`) where the ranks may read each other's memory: one copy
        instead of two.  A rank must then not touch its block until the others have read
        it, so the call ends with a barrier, unless ``finish`` is False: the caller's next
        barrier in this group comes after the reads (and the caller leaves those blocks alone
        until then)."""
        if self.size == 1 or out.size == 0:
            return True
        if self._reads(out):
            self._read_blocks(out, counts, finish)
            return True
        if not self._ensure(-(-out.nbytes // self.size)):
            return False
        r = self.rank
        bounds = segment_bounds(counts)
        per = self.size * self._slot // out.itemsize
        for start in range(0, out.size, per):
            end = min(out.size, start + per)
            area = self._area(out.dtype)
            lo, hi = max(bounds[r], start), min(bounds[r + 1], end)
            if hi > lo:
                area[lo - start:hi - start] = out[lo:hi]
            self.barrier()
            for p in range(self.size):
                lo, hi = max(bounds[p], start), min(bounds[p + 1], end)
                if p != r and hi > lo:
                    out[lo:hi] = area[lo - start:hi - start]
        return True

    def _reads(self, flat):
        """Whether a reduce-scatter or allgather of ``flat`` reads the blocks from their
        owners (:mod:`hora.backends.cma`); the same answer on every rank."""
        return (flat.nbytes >= _CMA_BYTES and self._cma is not False
                and self._ensure(_ALIGN) and self._readable())

    def _readable(self):
        """Collective the first time: whether every rank of the group can read every
        other's memory.  Each rank puts its pid, a random number and the address of a word
        holding that number in its line; after a barrier it reads every other's word
        (:func:`hora.backends.cma.probe`) and says whether that worked; after a second, the
        group reads when every rank said so (a rank with ``cma_reads`` off says no)."""
        if self._cma is not None:
            return self._cma
        words = self._words
        if words is None:               # (no words on this machine: not x86-64 Linux)
            self._cma = False
            return False
        nonce = int.from_bytes(os.urandom(7), "little")
        word = ctypes.c_uint64(nonce)
        line = self.rank * _LINE_WORDS
        words[line + _PID] = os.getpid()
        words[line + _NONCE] = nonce
        words[line + _AG_ADDR] = ctypes.addressof(word)
        self.barrier()
        self._pids = [words[p * _LINE_WORDS + _PID] for p in range(self.size)]
        ok = self._cma_wanted and all(
            cma.probe(self._pids[p], words[p * _LINE_WORDS + _AG_ADDR],
                      words[p * _LINE_WORDS + _NONCE])
            for p in range(self.size) if p != self.rank)
        words[line + _CMA_OK] = 1 if ok else 2
        self.barrier()
        self._cma = all(words[p * _LINE_WORDS + _CMA_OK] == 1 for p in range(self.size))
        if not self._cma and self.rank == 0:
            log.info("shared memory: the ranks of this host do not read each other's memory "
                     "(process_vm_readv refused, or HORA_SHM_CMA=0); large gathers go "
                     "through the segment")
        return self._cma

    def _publish(self, flat, word):
        """Put ``flat``'s address in this rank's ``word``, pass a barrier, and return every
        rank's address."""
        words = self._words
        words[self.rank * _LINE_WORDS + word] = flat.ctypes.data
        self.barrier()
        return [words[p * _LINE_WORDS + word] for p in range(self.size)]

    def _read(self, p, remote, local, nbytes):
        try:
            cma.read(self._pids[p], remote, local, nbytes)
        except OSError as e:
            me, them = self._job_rank(self.rank), self._job_rank(p)
            text = (f"rank {me}: could not read rank {them}'s buffer in a shared-memory "
                    f"collective (process_vm_readv: {e.strerror})")
            if e.errno == errno.ESRCH:
                self._t.watch(timeout=0)    # one that hung up first: the error names it
                raise TransportBrokenError(text + ": its process is gone", them) from None
            self._find_lost(text)
            raise HoraInternalError(f"{text}: rank {them} left the collective, and no rank "
                                    f"was found lost within {_LOST_S:g} s") from None

    def _find_lost(self, text):
        """Raise TransportBrokenError naming a lost rank, if one shows within _LOST_S.

        A live owner whose buffer is unmapped (EFAULT) has left the collective, most often
        because it found a rank gone.  That rank may not show here yet: a killed process
        lets go of its memory before it closes its connections, so the owner may have read
        it gone while its sockets are still open.  So look at both: the transport's hang-ups
        (any rank of the job) and this group's processes (:func:`hora.backends.cma.gone`)."""
        deadline = time.monotonic() + _LOST_S
        wait = 0.0
        while True:
            self._t.watch(timeout=wait)     # a hang-up: TransportBrokenError names it
            for q, pid in enumerate(self._pids):
                if q != self.rank and cma.gone(pid):
                    lost = self._job_rank(q)
                    raise TransportBrokenError(
                        f"{text}: rank {lost}'s process is gone", lost) from None
            if time.monotonic() >= deadline:
                return
            wait = _WATCH_S * 10

    def _read_blocks(self, out, counts, finish):
        """Allgather by reading every other rank's block from its ``out`` (see allgather)."""
        addrs = self._publish(out, _AG_ADDR)
        bounds = segment_bounds(counts)
        size, here = out.itemsize, out.ctypes.data
        for p in range(self.size):
            lo, hi = bounds[p], bounds[p + 1]
            if p != self.rank and hi > lo:
                self._read(p, addrs[p] + lo * size, here + lo * size, (hi - lo) * size)
        if finish:
            self.barrier()

    def _reduce_blocks(self, flat, counts, reduce_fn, finish):
        """Reduce-scatter by reading the other ranks' inputs of this rank's block from their
        ``flat``, a part at a time, each reduced into the block at once: own input first,
        then the others in rank order, as through the segment (the same bits)."""
        addrs = self._publish(flat, _RS_ADDR)
        r = self.rank
        bounds = segment_bounds(counts)
        size = flat.itemsize
        if self._part is None:
            self._part = np.empty(_CMA_PART, dtype=np.uint8)
        part = self._part[:_CMA_PART - _CMA_PART % size].view(flat.dtype)
        at = part.ctypes.data
        for lo in range(bounds[r], bounds[r + 1], part.size):
            hi = min(bounds[r + 1], lo + part.size)
            acc, into = flat[lo:hi], part[:hi - lo]
            for p in range(self.size):
                if p != r:
                    self._read(p, addrs[p] + lo * size, at, (hi - lo) * size)
                    reduce_fn(acc, into, out=acc)
        if finish:
            self.barrier()

    def broadcast(self, flat, root):
        """Copy ``root``'s ``flat`` to every rank.  False if shm is unusable."""
        if self.size == 1 or flat.size == 0:
            return True
        if not self._ensure(-(-flat.nbytes // self.size)):
            return False
        per = self.size * self._slot // flat.itemsize
        for start in range(0, flat.size, per):
            end = min(flat.size, start + per)
            area = self._area(flat.dtype)
            if self.rank == root:
                area[:end - start] = flat[start:end]
            self.barrier()
            if self.rank != root:
                flat[start:end] = area[:end - start]
        return True

    def alltoall(self, send, send_counts, recv, recv_counts):
        """Declined (False): not done through shared memory; the caller runs the pairwise
        exchange over the transport."""
        return False


def _gather_results(chunk, slots, ranges, own):
    """Copy every other rank's published sub-range of ``chunk`` out of its slot."""
    for p, (lo, hi) in enumerate(ranges):
        if p != own and hi > lo:
            chunk[lo:hi] = slots[p][lo:hi]


def _reduce_into(acc, parts, own, reduce_fn):
    """acc (holding part ``own``) = the reduction of every part: own first, then the others
    in rank order.  Each element is computed by one rank only, so every rank reads the same
    bits."""
    for p, part in enumerate(parts):
        if p != own:
            reduce_fn(acc, part, out=acc)
