"""Hierarchical allreduce: shared memory inside each host, the TCP ring between hosts.

With L ranks on each of H hosts, a buffer is cut into L blocks.  Inside a host, local rank j
gets block j reduced over the host through shared memory (a reduce-scatter); then the H ranks
that share local rank j, one per host, allreduce block j over TCP; then every host gathers
its L blocks back through shared memory.  Only 1/L of the buffer crosses the network per rank,
and the hosts' links carry L rings at once.

A large buffer goes through the three stages in pieces, one piece after the other, so that
each stage finds the piece's data in the caches where the previous stage (or the local peer)
left it rather than in memory.  A piece is a number of bytes per rank of the job, so that
each step of the ring between hosts still moves that many bytes.  Small pieces keep the data
in the caches; each piece also costs a few hand-offs between a host's ranks, which are process
switches where the ranks share the CPUs.  Which wins depends on the machine: 64 MiB over 2
hosts x 2 ranks of a 2-CPU machine took 53 ms in pieces of 128 KiB a rank and 73 ms in one
piece on one machine (network-namespace hosts), and on another 172-191 ms in pieces of 128
KiB, 123-144 ms of 512 KiB and 136-161 ms of 2 MiB (two host names of one namespace;
``benchmarks/allreduce_multihost.py``, docs/performance-notes.md).  Where a host's ranks read each
other's buffers directly (pieces of at least 8 MiB: ShmGroup, :mod:`hora.backends.cma`),
large pieces win: on the second machine 84-86 ms in pieces of 8 or 16 MiB a rank, 94-102 ms
of 2 MiB, against 101-136 ms for the best size through the segment.
So unless HORA_HIERARCHICAL_PIECE_BYTES sets it, the plane measures: its first allreduces of at
least :data:`TRIAL_BYTES` take turns between the sizes of :data:`PIECE_CANDIDATES`
(:class:`_PieceTrials`), and the job keeps the size that took the least time per byte,
summed over every rank (one small allreduce of the times, the same on every rank, so every
rank keeps the same size).  Until then, and for smaller buffers, the piece is
:data:`PIECE_BYTES`.  (Across three hosts or more, where an element sits in its piece decides
which host's value the ring adds first, so a result's last bits may differ between piece
sizes; every rank still gets the same bits.)

Needs every host to hold the same number of ranks (a homogeneous job); the caller checks.
Layer: backends.
"""
import logging
import time

import numpy as np

from . import ring
from .group import SubsetTransport
from .shm import ShmGroup, vote

__all__ = ["Hierarchical", "PIECE_BYTES", "PIECE_CANDIDATES", "TRIAL_BYTES"]

log = logging.getLogger(__name__)

PIECE_BYTES = 128 << 10     # of a piece, per rank of the job, until measured (see above)
PIECE_CANDIDATES = (128 << 10, 512 << 10, 2 << 20, 8 << 20)   # the sizes measured, a rank's
TRIAL_BYTES = 8 << 20       # an allreduce of at least this many bytes is a trial
TRIAL_ROUNDS = 3            # calls of each candidate; the first of each is not counted


class Hierarchical:
    """Allreduce across hosts in three stages (see the module docstring); a
    :class:`~hora.backends.base.Plane` that declines the other collectives.

    Args:
        t: the job's transport (every rank).
        hosts: each rank's host name, in rank order.
        slot_bytes: shared-memory chunk size (see ShmGroup).
        piece_bytes: a piece's bytes per rank of the job; 0: measure (see the module's
            docstring).
        cma_reads: whether a host's ranks may read each other's buffers (see ShmGroup).
    """

    name = "hierarchical"      # how the timeline and the metrics call this plane

    def __init__(self, t, hosts, slot_bytes=4 << 20, piece_bytes=0, cma_reads=True):
        if piece_bytes < 0:
            raise ValueError(f"HORA_HIERARCHICAL_PIECE_BYTES={piece_bytes}: expected a "
                             f"number of bytes, or 0 (measure)")
        me = hosts[t.rank]
        local = [r for r, h in enumerate(hosts) if h == me]
        order = list(dict.fromkeys(hosts))
        local_index = local.index(t.rank)
        cross = [[r for r, h in enumerate(hosts) if h == host][local_index] for host in order]
        self._local_t = SubsetTransport(t, local)
        self._cross_t = SubsetTransport(t, cross)
        # a host whose shared memory fails cannot fall back alone (the hosts would run
        # different algorithms): the job agrees up front (agree()), and later failures raise
        self._shm = ShmGroup(self._local_t, slot_bytes, fallback=False, cma_reads=cma_reads)
        self._t = t
        self._set_piece(piece_bytes)

    def _set_piece(self, piece_bytes):
        """Cut buffers into pieces of ``piece_bytes`` per rank of the job; 0: measure (and
        meanwhile use PIECE_BYTES)."""
        self._piece = (piece_bytes or PIECE_BYTES) * self._t.size
        self._trials = None if piece_bytes else _PieceTrials(PIECE_CANDIDATES, TRIAL_ROUNDS)

    @property
    def piece_bytes(self):
        """A piece's bytes per rank of the job: measured, set, or (while it is measured)
        :data:`PIECE_BYTES`."""
        return self._piece // self._t.size

    def measures(self, nbytes):
        """Whether an allreduce of ``nbytes`` would be a trial of the piece sizes now (they
        are still being measured, and it is large enough)."""
        return self._trials is not None and nbytes >= TRIAL_BYTES

    @property
    def spin_s(self):
        return self._shm.spin_s

    @spin_s.setter
    def spin_s(self, value):
        self._shm.spin_s = value

    def agree(self):
        """Collective over every rank: take rank 0's piece size (a rank whose own setting
        differs logs a warning: the ranks must cut buffers into the same pieces), and set up
        shared memory on every host; True when it works everywhere (else the job uses the
        flat TCP ring)."""
        mine = self.piece_bytes if self._trials is None else 0
        chosen = np.array([mine], dtype=np.int64)
        ring.broadcast(self._t, chosen, 0)
        if chosen[0] != mine:
            log.warning("rank %d: HORA_HIERARCHICAL_PIECE_BYTES is %d here but %d on rank 0; "
                        "using rank 0's (0: measured)", self._t.rank, mine, chosen[0])
            self._set_piece(int(chosen[0]))
        return vote(self._t, self._shm.try_setup())

    def allreduce(self, flat, reduce_fn):
        trials = self._trials
        if trials is None or flat.nbytes < TRIAL_BYTES:
            self._in_pieces(flat, reduce_fn, self._piece)
            return True
        # a trial: every rank sees the same buffers in the same order, so it makes the same
        # trials, and takes part in the same exchange of their times after the last one
        size = self._t.size
        candidate = trials.next()
        started = time.perf_counter()
        self._in_pieces(flat, reduce_fn, candidate * size)
        if trials.record(candidate, (time.perf_counter() - started) / flat.nbytes):
            times = trials.times()
            ring.allreduce(self._t, times, np.add)      # the same bits on every rank
            best = trials.candidates[int(np.argmin(times))]
            self._piece, self._trials = best * size, None
            if self._t.rank == 0:
                log.info("hierarchical allreduce: pieces of %d KiB a rank (of %s KiB: "
                         "%s ns a byte, summed over the ranks)", best >> 10,
                         "/".join(str(c >> 10) for c in trials.candidates),
                         "/".join(f"{x * 1e9:.3g}" for x in times))
        return True

    def _in_pieces(self, flat, reduce_fn, piece):
        step = max(1, piece // flat.itemsize)
        for lo in range(0, flat.size, step):    # (the same pieces on every rank)
            self._allreduce(flat[lo:lo + step], reduce_fn, lo + step >= flat.size)

    def _allreduce(self, flat, reduce_fn, last=True):
        counts = ring.even_counts(flat.size, self._local_t.size)
        self._shm.reducescatter(flat, counts, reduce_fn, finish=False)
        bounds = ring.segment_bounds(counts)
        r = self._local_t.rank
        ring.allreduce(self._cross_t, flat[bounds[r]:bounds[r + 1]], reduce_fn)
        # the host's ranks may read this piece's blocks from each other's buffers until the
        # next piece's first barrier, which they reach after the reads; the last waits here
        self._shm.allgather(flat, counts, finish=last)

    # the other collectives: the flat TCP algorithms (the engine falls back when False)
    def reducescatter(self, flat, counts, reduce_fn):
        return False

    def allgather(self, out, counts):
        return False

    def broadcast(self, flat, root):
        return False

    def alltoall(self, send, send_counts, recv, recv_counts):
        return False

    def close(self):
        self._shm.close()


class _PieceTrials:
    """The plan of the piece sizes' trials: ``rounds`` rounds, each trying every candidate
    once in turn (so that a machine whose speed drifts over the trials slows every
    candidate alike); the first round is not counted (first touches of the shared memory,
    caches).  A candidate's time is the sum of its counted calls' seconds per byte."""

    def __init__(self, candidates, rounds):
        self.candidates = tuple(candidates)
        self._plan = [c for _ in range(rounds) for c in self.candidates]
        self._done = 0
        self._times = dict.fromkeys(self.candidates, 0.0)

    def next(self):
        """The candidate of the next trial."""
        return self._plan[self._done]

    def record(self, candidate, seconds_per_byte):
        """The trial of ``candidate`` took that long; True after the last trial."""
        if self._done >= len(self.candidates):
            self._times[candidate] += seconds_per_byte
        self._done += 1
        return self._done == len(self._plan)

    def times(self):
        """Each candidate's time, in their order (float64: to add up over the ranks)."""
        return np.array([self._times[c] for c in self.candidates], dtype=np.float64)
