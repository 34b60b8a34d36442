"""Beyond HORA_CONTROL_FANOUT + 1 hosts the leaders form a tree (issue 63): real ranks on three
"hosts" of this machine with HORA_CONTROL_FANOUT=1, so that host c's leader (rank 4) talks to
host b's (rank 2), which alone talks to rank 0; results checked against NumPy.

* The control connections: 1 and 2 to rank 0, 3 and 4 to 2, 5 to 4; no host boards (the
  leaders' host rounds need every leader connected to rank 0).
* Cached allreduces (small ones, whose inputs travel with their requests, and larger) give
  NumPy's sums, leader 2 sending rank 0 its host's and leader 4's cached requests as one
  message where they sent several; so do a process set across the hosts (its ids are passed
  on, not held), an allgather and a broadcast.
* A rank two leaders away that comes late is named by rank 0's stall inspector with its
  stack; one that dies is named by every survivor.
"""

import numpy as np
import pytest

from tests.helpers import RawJob
from tests.multiproc.board_hosts_jobs import run_on
from tests.multiproc.test_leaders import die_in_a_loop

HOSTS = "127.0.0.1:2,127.0.0.2:2,127.0.0.3:2"
PLACES = [("127.0.0.1", 2), ("127.0.0.2", 2), ("127.0.0.3", 2)]
N = 6
TREE = {"HORA_CONTROL_FANOUT": "1"}
STEPS = 20
SIZES = [4, 64, 1 << 14]     # floats: two small allreduces (inputs with the requests), one not


def _work():
    import logging
    import time

    import hora
    from hora.core import state
    said = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())
    logging.getLogger("hora").addHandler(Keep())
    rank, engine = hora.rank(), state.engine()
    side = engine._side
    tree = (type(side).__name__, side.parent if rank else None,
            sorted(c.peer for c in side.conns), engine._board is not None)
    grads = [np.full(n, rank + 1.0, np.float32) for n in SIZES]
    desk = getattr(side, "desk", None)
    for step in range(STEPS):
        handles = [hora.allreduce_async(g * (step + 1), op=hora.Sum, name=f"g{i}")
                   for i, g in enumerate(grads)]
        outs = [hora.synchronize(h).tolist()[:2] for h in handles]
    counts = desk and (desk.sent_host, desk.sent_fwd)
    edge = hora.add_process_set([1, 5])
    for step in range(3):
        handles = [hora.allreduce_async(g, op=hora.Sum, name=f"g{i}")
                   for i, g in enumerate(grads)]
        if rank in (1, 5):
            handles.append(hora.allreduce_async(np.full(3, rank, np.float32), op=hora.Sum,
                                                name="edge", process_set=edge))
        outs += [hora.synchronize(h).tolist()[:2] for h in handles]
    gathered = hora.allgather(np.full((rank + 1, 2), rank, np.int64), name="ag").tolist()
    sent = hora.broadcast(np.arange(5.0) * (rank + 1), root_rank=4, name="bc").tolist()
    if rank == 5:                           # cached: the leaders hold their ranks' ids
        time.sleep(2.5)
    late = hora.allreduce(np.ones(4, np.float32), op=hora.Sum, name="g_late").tolist()
    return {"tree": tree, "outs": outs, "gathered": gathered, "sent": sent, "desk": counts,
            "late": late, "said": said if rank == 0 else None}


@pytest.mark.timeout(60)
def test_a_tree_of_leaders_carries_the_job_and_names_a_late_rank():
    results = run_on(_work, hosts=HOSTS, timeout_s=45,
                     env=dict(TREE, HORA_STALL_CHECK_TIME_SECONDS="1"))
    trees = [res["tree"] for res in results]
    assert trees[0] == ("CoordinatorSide", None, [1, 2], False)
    assert trees[1] == ("WorkerSide", 0, [0], False)
    assert trees[2] == ("LeaderSide", 0, [0, 3, 4], False)
    assert trees[3] == ("WorkerSide", 2, [2], False)
    assert trees[4] == ("LeaderSide", 2, [2, 5], False)
    assert trees[5] == ("WorkerSide", 4, [4], False)
    total = sum(r + 1.0 for r in range(N))
    want_ag = [[r, r] for r in range(N) for _ in range(r + 1)]
    for rank, res in enumerate(results):
        want = [[total * STEPS] * 2] * len(SIZES) + (
            [[total] * 2] * len(SIZES) + ([[6.0, 6.0]] if rank in (1, 5) else [])) * 3
        assert res["outs"] == want, rank
        assert res["gathered"] == want_ag
        assert res["sent"] == (np.arange(5.0) * 5).tolist()
        assert res["late"] == [float(N)] * 4
    # leader 2: its host's and leader 4's cached requests went up as whole messages
    sent_host, sent_fwd = results[2]["desk"]
    assert sent_host >= STEPS // 2 and sent_fwd <= sent_host, (sent_host, sent_fwd)
    said = "\n".join(results[0]["said"])
    missing = [line for line in said.splitlines() if line[:2] in {f"{r}:" for r in range(N)}]
    assert missing and all(line.startswith("5:") for line in missing), said
    assert "rank 5:" in said and "time.sleep(2.5)" in said, said    # asked through 4 and 2


@pytest.mark.timeout(60)
def test_a_rank_two_leaders_away_that_dies_is_named_by_every_survivor(tmp_path):
    job = RawJob(die_in_a_loop, N, tmp_path, args=(5,), hosts=PLACES, env=TREE)  # 4, 2 above
    results = job.results(timeout_s=40)
    assert results[5] is None               # killed: no result
    for rank in range(5):
        assert results[rank] == ("ok", 5), (rank, results[rank], job.stderr(rank)[-2000:])
