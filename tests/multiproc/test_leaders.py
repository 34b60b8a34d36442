"""A job on several hosts talks to rank 0 through its hosts' leaders (issue 63): real ranks on
two "hosts" of this machine (``hora.runner.run(hosts="127.0.0.1:3,127.0.0.2:3")``: each rank's
HORA_HOSTNAME says which), the results checked against NumPy.

* The control connections form a tree: rank 0 holds those of the hosts' leaders, its own
  host's next rank (1, to which rank 2 connects) and the other host's lowest (3, to which 4
  and 5 connect).
* In a loop of cached allreduces (asynchronous, under stable names; small ones, whose inputs
  travel with their requests, and larger ones), the leader sends rank 0 its host's requests
  as one message where its ranks sent one each: rank 0 receives fewer messages than the
  workers sent, and the results are the sums.
* A rank behind the leader that dies is named by every survivor.
"""
import os
import signal

import numpy as np
import pytest

from tests.helpers import RawJob
from tests.multiproc.board_hosts_jobs import run_on

HOSTS = "127.0.0.1:3,127.0.0.2:3"
N = 6
STEPS = 30
SIZES = [4, 64, 1 << 14]     # floats: two small allreduces (inputs with the requests), one not


def _loop():
    import hora
    from hora.core import state
    rank = hora.rank()
    side = state.engine()._side
    tree = (type(side).__name__, side.parent if rank else None,
            sorted(c.peer for c in side.conns))
    grads = [np.full(n, rank + 1.0, np.float32) for n in SIZES]
    control = hora.metrics()["control"]
    for step in range(STEPS):
        handles = [hora.allreduce_async(g * (step + 1), op=hora.Sum, name=f"g{i}")
                   for i, g in enumerate(grads)]
        outs = [hora.synchronize(h) for h in handles]
    after = hora.metrics()["control"]
    desk = getattr(side, "desk", None)
    return {"tree": tree, "last": [o.tolist()[:2] for o in outs],
            "received": after["received"] - control["received"],
            "sent": after["sent"] - control["sent"],
            "desk": desk and (desk.sent_host, desk.sent_fwd)}


@pytest.mark.timeout(60)
def test_a_host_speaks_to_rank_0_through_its_leader():
    results = run_on(_loop, hosts=HOSTS, timeout_s=45)
    trees = {r: res["tree"] for r, res in enumerate(results)}
    assert trees[0] == ("CoordinatorSide", None, [1, 3])
    assert trees[1] == ("LeaderSide", 0, [0, 2])
    assert trees[2] == ("WorkerSide", 1, [1])
    assert trees[3] == ("LeaderSide", 0, [0, 4, 5])
    assert trees[4] == trees[5] == ("WorkerSide", 3, [3])
    total = sum(r + 1.0 for r in range(N)) * STEPS
    for res in results:
        assert res["last"] == [[total, total]] * len(SIZES)
    # each leader's host: its ranks' requests went up as whole-host messages
    for leader in (1, 3):
        sent_host, sent_fwd = results[leader]["desk"]
        assert sent_host >= STEPS // 2 and sent_fwd <= sent_host, (leader, sent_host, sent_fwd)
    # (ranks 2, 4 and 5 send only requests; a leader sends its ranks responses too)
    sent_host, sent_fwd = results[3]["desk"]
    from_host = results[4]["sent"] + results[5]["sent"]
    assert sent_host + sent_fwd < from_host, (sent_host, sent_fwd, from_host)
    # rank 0 heard less than the ranks behind the leaders said
    behind = results[2]["sent"] + from_host
    assert results[0]["received"] < behind, (results[0]["received"], behind)


def die_in_a_loop(victim):
    """Rank ``victim`` SIGKILLs itself in a loop of allreduces; a survivor returns the rank
    its error names."""
    import hora
    hora.init()
    x = np.ones(4, np.float32)
    try:
        for i in range(10000):
            if i == 20 and hora.rank() == victim:
                os.kill(os.getpid(), signal.SIGKILL)
            hora.allreduce(x, op=hora.Sum, name="loop")
    except hora.HoraRankFailedError as e:
        return e.rank
    return None


@pytest.mark.timeout(60)
def test_a_rank_behind_the_leader_that_dies_is_named_by_every_survivor(tmp_path):
    job = RawJob(die_in_a_loop, N, tmp_path, args=(4,),       # rank 4: behind leader 3
                 hosts=[("127.0.0.1", 3), ("127.0.0.2", 3)])
    results = job.results(timeout_s=40)
    assert results[4] is None               # killed: no result
    for rank in (0, 1, 2, 3, 5):
        assert results[rank] == ("ok", 4), (rank, results[rank], job.stderr(rank)[-2000:])


def _stall_behind_the_leader():
    """Rank 4 (behind leader 3) comes 3 s late to an allreduce the others wait for; rank 0
    returns what its stall inspector logged (HORA_STALL_CHECK_TIME_SECONDS=1)."""
    import logging
    import time

    import hora
    said = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())
    logging.getLogger("hora").addHandler(Keep())
    x = np.ones(4, np.float32)
    for _ in range(3):                      # cached: the leader holds its host's ids
        hora.synchronize(hora.allreduce_async(x, op=hora.Sum, name="g"))
    if hora.rank() == 4:
        time.sleep(3)
    out = hora.synchronize(hora.allreduce_async(x, op=hora.Sum, name="g"))
    return out.tolist(), said


@pytest.mark.timeout(60)
def test_the_stall_inspector_names_the_late_rank_behind_a_leader_and_shows_its_stack():
    results = run_on(_stall_behind_the_leader, hosts=HOSTS, timeout_s=45,
                     env={"HORA_STALL_CHECK_TIME_SECONDS": "1"})
    for out, _ in results:
        assert out == [float(N)] * 4
    said = "\n".join(results[0][1])
    missing = [line for line in said.splitlines() if line[:2] in {f"{r}:" for r in range(N)}]
    assert missing and all(line.startswith("4:") for line in missing), said
    assert "rank 4:" in said and "time.sleep(3)" in said, said      # its main thread's stack
