"""Jobs on several "hosts" of this machine for the boards' tests across hosts
(test_board_hosts*.py): the host lists, running a function on every rank of such a job, and
checking that the job has the places and the data plane the tests mean."""
import os

import numpy as np

import hora
import hora.core.engine.board as _board

HOSTS = "localhost:2,127.0.0.1:2"           # 2 hosts of 2 ranks: 0 1 | 2 3
HOSTS_3 = "localhost:3,127.0.0.1:3"         # 2 hosts of 3 ranks: 0 1 2 | 3 4 5
THREE_HOSTS = "localhost:2,127.0.0.1:2,127.0.0.2:2"     # 3 hosts of 2 ranks: 0 1 | 2 3 | 4 5
# hosts of one rank each, or of different sizes: the TCP ring is the data plane, and each
# host has a board all the same (a host of one rank: a board of one)
TWO_ONES = "localhost:1,127.0.0.1:1"                                # 0 | 1
FOUR_ONES = "localhost:1,127.0.0.1:1,127.0.0.2:1,127.0.0.3:1"      # 0 | 1 | 2 | 3
TWO_ONE = "localhost:2,127.0.0.1:1"                                 # 0 1 | 2
ONE_THREE = "localhost:1,127.0.0.1:3"                               # 0 | 1 2 3
AUTO = {"HORA_BACKEND": "auto"}
OFF = {"HORA_BACKEND": "auto", "HORA_SHM_BOARD": "0"}

STRIPE_BYTES = _board.STRIPE_BYTES          # from this size on: the engine, across hosts
E32 = STRIPE_BYTES // 4                     # float32 elements of 64 KiB


def slots(hosts):
    """``"a:2,b:2"`` -> ``[("a", 2), ("b", 2)]``."""
    out = []
    for entry in hosts.split(","):
        name, count = entry.rsplit(":", 1)
        out.append((name, int(count)))
    return out


def np_of(hosts):
    return sum(c for _, c in slots(hosts))


def in_job(fn, args):
    hora.init()
    try:
        return fn(*args)
    finally:
        hora.shutdown()


def run_on(fn, hosts=HOSTS, args=(), env=None, timeout_s=45):
    """``fn(*args)`` on every rank of a job on ``hosts`` (between hora.init() and shutdown());
    the results by rank."""
    from hora.runner import run
    return run(in_job, args=(fn, args), np=np_of(hosts), hosts=hosts,
               env=dict(AUTO, **(env or {})), timeout_s=timeout_s)


def where():
    """This rank's place, as the job sees it."""
    from hora.core import state
    return dict(rank=hora.rank(), size=hora.size(), local_rank=hora.local_rank(),
                local_size=hora.local_size(), cross_rank=hora.cross_rank(),
                cross_size=hora.cross_size(), host=os.environ.get("HORA_HOSTNAME"),
                plane=type(state.engine()._plane).__name__)


def plane_of(hosts):
    """The data plane a job on ``hosts`` has: the hierarchical one (hosts of the same number
    of ranks, more than one), else the TCP ring (no plane object)."""
    counts = {c for _, c in slots(hosts)}
    return "Hierarchical" if len(counts) == 1 and counts != {1} else "NoneType"


def host_groups(wheres, hosts=HOSTS):
    """The ranks of each host, hosts in the order of the -H list, ranks in rank order; checks
    that the job is the one on several hosts the tests mean."""
    places = slots(hosts)
    n = np_of(hosts)
    assert [w["rank"] for w in wheres] == list(range(n)), wheres
    groups, first = {}, []
    for w in wheres:
        if w["host"] not in groups:
            first.append(w["host"])
            groups[w["host"]] = []
        groups[w["host"]].append(w["rank"])
    assert first == [name for name, _ in places], (first, places)
    for w in wheres:
        assert w["plane"] == plane_of(hosts), f"rank {w['rank']}: data plane {w['plane']}"
        assert w["size"] == n
        assert w["local_size"] == len(groups[w["host"]])
        assert w["local_rank"] == groups[w["host"]].index(w["rank"])
        # (Horovod's cross ranks: among the hosts that have a rank of this local rank)
        peers = [h for h in first if len(groups[h]) > w["local_rank"]]
        assert w["cross_size"] == len(peers) and w["cross_rank"] == peers.index(w["host"])
    return [groups[h] for h in first]


def step_input(i, rank, n=3):
    """Integer-valued floats: any order of their sums gives the same bits."""
    return np.arange(n, dtype=np.float64) + 10.0 * rank + i
