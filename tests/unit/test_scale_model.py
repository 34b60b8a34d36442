"""benchmarks/scale_model.py runs hora's own control plane in one process: with hosts of 8, a
leader sends rank 0 its host's requests in fewer messages than its ranks sent it, so rank 0
reads a few messages a host a step; one host (no leader) reads every rank's; beyond
HORA_CONTROL_FANOUT + 1 hosts, a few a leader connected to it, whatever the hosts."""
import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks")


@pytest.fixture(scope="module")
def scale_model():
    sys.path.insert(0, BENCHMARKS)
    try:
        import scale_model
        yield scale_model
    finally:
        sys.path.remove(BENCHMARKS)


def test_rank_0_reads_a_few_messages_a_host_not_one_a_rank(scale_model):
    batches = 2
    one_host = scale_model.model(8, 8, batches)
    assert one_host["leader"] is None
    assert one_host["rank0"]["received"] == 7 * batches         # every other rank's requests
    many = scale_model.model(256, 8, batches, fanout=31)     # every leader to rank 0
    assert (many["hosts"], many["depth"]) == (32, 2)
    leader = many["leader"]
    assert leader["received"] >= 7 * batches                    # its host's ranks' requests
    up = leader["sent"] - 7 * (leader["received"] - 7 * batches)  # less what it passed down
    assert 1 <= up <= 7 * batches, leader
    # rank 0: its own host's 7 ranks and 31 leaders, each a few messages, not 255 ranks'
    assert 38 <= many["rank0"]["received"] <= 38 * 2 * batches, many["rank0"]
    assert many["rank0"]["received"] < 255 * batches


def test_in_a_tree_of_leaders_rank_0_reads_a_few_messages_a_leader_below_it(scale_model):
    batches = 2
    flat = scale_model.model(256, 8, batches, fanout=31)
    tree = scale_model.model(256, 8, batches, fanout=4)
    assert tree["depth"] == 4                   # 31 leaders: 4, 16, 11 of them a level
    # rank 0: its host's 7 ranks and 4 leaders, each a few messages
    assert 11 <= tree["rank0"]["received"] <= 11 * 2 * batches, tree["rank0"]
    assert tree["rank0"]["received"] * 2 < flat["rank0"]["received"]
    assert tree["rank0"]["sent"] * 2 < flat["rank0"]["sent"]
