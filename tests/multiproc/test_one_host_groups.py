"""A job on one host of more than HORA_CONTROL_FANOUT + 1 ranks is led as hosts of that many
ranks would be (issue 63): 7 ranks on one host with HORA_CONTROL_FANOUT=2 form the groups
{0, 1} {2, 3} {4, 5} {6}, whose leaders 2 and 4 talk to rank 0 and 6 to 2 (a tree, as hosts'
leaders); the host keeps its one board, whose posts rank 0 answers.  Results checked against
NumPy.

* The control connections, and the board.
* Cached allreduces (small ones, whose inputs travel with their requests, and larger),
  blocking ones on the board, an allgather and a broadcast give NumPy's answers; so do an
  allreduce under way in rank 0's engine while the others post another on the board (their
  posts go to the engine when rank 0's engine steps: their nudges pass the leaders).
* A rank behind a leader that dies is named by every survivor.
"""
import numpy as np
import pytest

from tests.helpers import RawJob
from tests.multiproc.board_hosts_jobs import run_on
from tests.multiproc.test_leaders import die_in_a_loop

N = 7
ONE_HOST = f"127.0.0.1:{N}"
GROUPS = {"HORA_CONTROL_FANOUT": "2"}
STEPS = 10
SIZES = [4, 64, 1 << 14]     # floats: two small allreduces (inputs with the requests), one not


def _work():
    import hora
    from hora.core import state
    rank, engine = hora.rank(), state.engine()
    side = engine._side
    tree = (type(side).__name__, side.parent if rank else None,
            sorted(c.peer for c in side.conns), engine._board is not None)
    grads = [np.full(n, rank + 1.0, np.float32) for n in SIZES]
    outs = []
    for step in range(STEPS):
        handles = [hora.allreduce_async(g * (step + 1), op=hora.Sum, name=f"g{i}")
                   for i, g in enumerate(grads)]
        outs = [hora.synchronize(h).tolist()[:2] for h in handles]
    board = [hora.allreduce(np.full(3, rank, np.float32), op=hora.Sum, name="b").tolist()
             for _ in range(20)]
    x, y = np.full(5, rank + 1.0, np.float32), np.full(2, 10.0 * rank, np.float32)
    if rank == 0:       # "x" under way in rank 0's engine while the others post "y"
        hx = hora.allreduce_async(x, op=hora.Sum, name="x")
        got_y = hora.allreduce(y, op=hora.Sum, name="y").tolist()
        crossed = [hora.synchronize(hx).tolist(), got_y]
    else:
        got_y = hora.allreduce(y, op=hora.Sum, name="y").tolist()
        crossed = [hora.allreduce(x, op=hora.Sum, name="x").tolist(), got_y]
    gathered = hora.allgather(np.full((rank + 1, 2), rank, np.int64), name="ag").tolist()
    sent = hora.broadcast(np.arange(5.0) * (rank + 1), root_rank=5, name="bc").tolist()
    return {"tree": tree, "outs": outs, "board": board, "crossed": crossed,
            "gathered": gathered, "sent": sent}


@pytest.mark.timeout(60)
def test_one_host_in_groups_carries_the_job():
    results = run_on(_work, hosts=ONE_HOST, timeout_s=45, env=GROUPS)
    trees = [res["tree"] for res in results]
    assert trees[0] == ("CoordinatorSide", None, [1, 2, 4], True)
    assert trees[1] == ("WorkerSide", 0, [0], True)
    assert trees[2] == ("LeaderSide", 0, [0, 3, 6], True)
    assert trees[3] == ("WorkerSide", 2, [2], True)
    assert trees[4] == ("LeaderSide", 0, [0, 5], True)
    assert trees[5] == ("WorkerSide", 4, [4], True)
    assert trees[6] == ("WorkerSide", 2, [2], True)
    total = sum(r + 1.0 for r in range(N))
    want_ag = [[r, r] for r in range(N) for _ in range(r + 1)]
    for rank, res in enumerate(results):
        assert res["outs"] == [[total * STEPS] * 2] * len(SIZES), rank
        assert res["board"] == [[float(sum(range(N)))] * 3] * 20, rank
        assert res["crossed"] == [[total] * 5, [10.0 * sum(range(N))] * 2], rank
        assert res["gathered"] == want_ag
        assert res["sent"] == (np.arange(5.0) * 6).tolist()


@pytest.mark.timeout(60)
def test_a_rank_behind_a_group_leader_that_dies_is_named_by_every_survivor(tmp_path):
    job = RawJob(die_in_a_loop, N, tmp_path, args=(5,),      # rank 5: behind leader 4
                 hosts=[("127.0.0.1", N)], env=GROUPS)
    results = job.results(timeout_s=40)
    assert results[5] is None               # killed: no result
    for rank in (0, 1, 2, 3, 4, 6):
        assert results[rank] == ("ok", 5), (rank, results[rank], job.stderr(rank)[-2000:])
