"""Hierarchical allreduce: shared memory inside each host, the TCP ring between hosts.

With L ranks on each of H hosts, a buffer is cut into L blocks.  Inside a host, local rank j
gets block j reduced over the host through shared memory (a reduce-scatter); then the H ranks
that share local rank j, one per host, allreduce block j over TCP; then every host gathers
its L blocks back through shared memory.  Only 1/L of the buffer crosses the network per rank,
and the hosts' links carry L rings at once.

A large buffer goes through the three stages in pieces, one piece after the other, so that
each stage finds the piece's data in the caches where the previous stage (or the local peer)
left it rather than in memory: 64 MiB on 2 network-namespace hosts x 2 ranks of a 2-CPU
machine took 73 ms in one piece and 53 ms in pieces of 512 KiB (medians of 5 launches of
``benchmarks/allreduce_multihost.py``; 58-62 ms against 41-46 ms between two host names of
one namespace).  A piece is :data:`PIECE_BYTES` per rank of the job, so that each step of the
ring between hosts still moves that many bytes (about 100 us at 10 Gb/s, a few round trips).

Needs every host to hold the same number of ranks (a homogeneous job); the caller checks.
Layer: backends.
"""
from . import ring
from .group import SubsetTransport
from .shm import ShmGroup, vote

__all__ = ["Hierarchical", "PIECE_BYTES"]

PIECE_BYTES = 128 << 10     # of a piece, per rank of the job (see above)


class Hierarchical:
    """Allreduce across hosts in three stages (see the module docstring); a
    :class:`~hora.backends.base.Plane` that declines the other collectives.

    Args:
        t: the job's transport (every rank).
        hosts: each rank's host name, in rank order.
        slot_bytes: shared-memory chunk size (see ShmGroup).
    """

    name = "hierarchical"      # how the timeline and the metrics call this plane

    def __init__(self, t, hosts, slot_bytes=4 << 20):
        me = hosts[t.rank]
        local = [r for r, h in enumerate(hosts) if h == me]
        order = list(dict.fromkeys(hosts))
        local_index = local.index(t.rank)
        cross = [[r for r, h in enumerate(hosts) if h == host][local_index] for host in order]
        self._local_t = SubsetTransport(t, local)
        self._cross_t = SubsetTransport(t, cross)
        # a host whose shared memory fails cannot fall back alone (the hosts would run
        # different algorithms): the job agrees up front (agree()), and later failures raise
        self._shm = ShmGroup(self._local_t, slot_bytes, fallback=False)
        self._t = t
        self._piece = PIECE_BYTES * len(hosts)

    @property
    def spin_s(self):
        return self._shm.spin_s

    @spin_s.setter
    def spin_s(self, value):
        self._shm.spin_s = value

    def agree(self):
        """Collective over every rank: set up shared memory on every host; True when it
        works everywhere (else the job uses the flat TCP ring)."""
        return vote(self._t, self._shm.try_setup())

    def allreduce(self, flat, reduce_fn):
        step = max(1, self._piece // flat.itemsize)
        for lo in range(0, flat.size, step):    # (the same pieces on every rank)
            self._allreduce(flat[lo:lo + step], reduce_fn)
        return True

    def _allreduce(self, flat, reduce_fn):
        counts = ring.even_counts(flat.size, self._local_t.size)
        self._shm.reducescatter(flat, counts, reduce_fn)
        bounds = ring.segment_bounds(counts)
        r = self._local_t.rank
        ring.allreduce(self._cross_t, flat[bounds[r]:bounds[r + 1]], reduce_fn)
        self._shm.allgather(flat, counts)

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
