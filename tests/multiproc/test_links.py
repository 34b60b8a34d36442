"""A job's data connections: each rank starts with its ring neighbours and connects to another
rank only when a collective needs it (issue 63: no full mesh).  Real ranks over TCP, the
results checked against NumPy."""
import os

import numpy as np
import pytest

from tests.helpers import run_ranks
from tests.multiproc.board_hosts_jobs import run_on

N = 6


def _sockets():
    """How many sockets this process holds (its file descriptors that are sockets)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count


def _held():
    """``{peer: fd}`` of every connection this rank holds to another rank: its data
    connections and its control ones (one fd a peer where a pair shares one)."""
    from hora.core import state
    t = state.transport()
    held = {(p, t._socks[p].fileno()) for p in t.peers}
    held |= {(c.peer, c.fileno()) for c in state.engine()._side.conns}
    return sorted(held)


def _connections():
    import hora
    from hora.core import state
    rank, size = hora.rank(), hora.size()
    peers = state.transport().peers
    at_init = (list(peers), _sockets(), _held())
    # a process set of the even ranks: its ring joins ranks that are not neighbours
    evens = hora.add_process_set(list(range(0, size, 2)))
    x = np.full(1 << 16, rank + 1.0, dtype=np.float32)
    out_set = hora.allreduce(x, op=hora.Sum, name="evens", process_set=evens) \
        if rank % 2 == 0 else None
    after_set = list(state.transport().peers)
    # an alltoall joins every pair
    got, _ = hora.alltoall(np.arange(size, dtype=np.float32) + 100 * rank, name="a2a")
    after_a2a = list(state.transport().peers)
    return {"at_init": at_init, "after_set": after_set, "after_a2a": after_a2a,
            "held": _held(),
            "set_sum": None if out_set is None else float(out_set[0]),
            "a2a": got.tolist()}


@pytest.mark.timeout(60)
def test_ranks_connect_to_their_ring_neighbours_then_to_whom_collectives_need():
    results = run_ranks(_connections, N, timeout_s=45, env={"HORA_BACKEND": "tcp"})
    evens = list(range(0, N, 2))
    for rank, res in enumerate(results):
        neighbours = sorted({(rank - 1) % N, (rank + 1) % N})
        peers, sockets, held = res["at_init"]
        assert peers == neighbours, (rank, peers)
        # on one host a pair's control connection and its data connection are two (a job
        # on several hosts shares them: below)
        ctrl = set(range(1, N)) if rank == 0 else {0}
        assert [p for p, _ in held] == sorted([*ctrl, *neighbours]), (rank, held)
        assert len({fd for _, fd in held}) == len(held), (rank, held)
        # those, the listener, its acceptor's wake-up pair, the rendezvous client and
        # hora.run's result channel (rank 0: and one more): a worker's does not grow with N
        assert sockets <= len(held) + (6 if rank == 0 else 5), (rank, sockets, held)
        want = sorted(set(neighbours) | (set(evens) - {rank} if rank in evens else set()))
        assert res["after_set"] == want, (rank, res["after_set"])
        assert res["after_a2a"] == sorted(set(range(N)) - {rank}), (rank, res["after_a2a"])
        if rank in evens:
            assert res["set_sum"] == sum(r + 1.0 for r in evens)
        assert res["a2a"] == [100.0 * src + rank for src in range(N)]


HOSTS = "127.0.0.1:5,127.0.0.2:5"     # two "hosts" of 5: more than ring.DIRECT_MAX in all


def _host_connections():
    import hora
    from hora.core import state
    rank = hora.rank()
    at_init = list(state.transport().peers)
    # a small allreduce (the hosts' boards), a large one (the hierarchical plane), an allgather
    small = hora.allreduce(np.full(4, rank + 1.0, np.float32), op=hora.Sum, name="small")
    large = hora.allreduce(np.full(1 << 18, rank + 1.0, np.float32), op=hora.Sum, name="big")
    rows = hora.allgather(np.full((1, 2), rank, np.int32), name="rows")
    return {"at_init": at_init, "after": list(state.transport().peers), "held": _held(),
            "small": small.tolist(), "large": float(large[-1]), "rows": rows[:, 0].tolist()}


@pytest.mark.timeout(60)
def test_a_hosts_ranks_connect_to_their_neighbours_not_to_every_rank_of_the_host():
    """The hosts' shared memory is set up along each host's ring: a rank of a host of 5
    connects to its two neighbours there, not to the four others; the collectives connect
    it to the rank of the same local rank on the other host, and to no one else."""
    n, per_host = 10, 5
    # the job's ring goes through the last host from its highest rank down, so that it
    # closes from that host's leader (5) to rank 0
    job_ring = [0, 1, 2, 3, 4, 9, 8, 7, 6, 5]
    results = run_on(_host_connections, hosts=HOSTS, timeout_s=45)
    total = sum(r + 1.0 for r in range(n))
    for rank, res in enumerate(results):
        host, local = divmod(rank, per_host)
        i = job_ring.index(rank)
        rings = {job_ring[i - 1], job_ring[(i + 1) % n],               # the job's ring
                 host * per_host + (local - 1) % per_host,           # the host's ring
                 host * per_host + (local + 1) % per_host}
        assert res["at_init"] == sorted(rings), (rank, res["at_init"])
        # the large allreduce's ring across hosts: the other host's rank of the same local rank
        assert res["after"] == sorted(rings | {(1 - host) * per_host + local}), \
            (rank, res["after"])
        # one connection a peer: a rank and its control parent (its host's leader: 1 on
        # rank 0's host, 5 on the other; rank 0 for those two) share theirs with their data
        # (ring neighbours, the large ring)
        parent = {0: None, 1: 0, 5: 0}.get(rank, 1 if host == 0 else 5)
        children = {0: [1, 5], 1: [2, 3, 4], 5: [6, 7, 8, 9]}.get(rank, [])
        want = set(res["after"]) | set(children) | ({parent} - {None})
        assert [p for p, _ in res["held"]] == sorted(want), (rank, res["held"])
        assert len({fd for _, fd in res["held"]}) == len(want), (rank, res["held"])
        if rank == 0:       # the two leaders and its neighbours on the rings, no one else
            assert want == {1, 4, 5}, res["held"]
        assert res["small"] == [total] * 4 and res["large"] == total
        assert res["rows"] == list(range(n))
