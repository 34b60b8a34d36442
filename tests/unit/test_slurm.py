"""Slurm: node lists and tasks-per-node as srun writes them, and the placement they give."""
import pytest

from hora.core.topology import detect_placement, expand_nodelist, expand_tasks_per_node

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("text,hosts", [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("node[01-03,07],login1", ["node01", "node02", "node03", "node07", "login1"]),
    ("gpu[8-11]", ["gpu8", "gpu9", "gpu10", "gpu11"]),
    ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
    ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
    ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
    ("a,b[2],c", ["a", "b2", "c"]),
    ("single", ["single"]),
])
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["", "n[1-", "n1]", "n[a-b]", "n[3-1]", "a,,b"])
def test_malformed_nodelists_name_the_list(text):
    with pytest.raises(ValueError, match="Slurm node list"):
        expand_nodelist(text)


def test_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="2x3"):
        expand_tasks_per_node("2x3")


def _srun_env(procid, nodeid, localid):
    # srun -N 3 -n 5 (block distribution): tasks per node 2,2,1
    return {"SLURM_PROCID": str(procid), "SLURM_NTASKS": "5", "SLURM_LOCALID": str(localid),
            "SLURM_NODEID": str(nodeid), "SLURM_STEP_NODELIST": "node[01-03]",
            "SLURM_JOB_NODELIST": "node[01-03,07]", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
            "SLURM_TASKS_PER_NODE": "2(x2),1", "SLURM_JOB_ID": "99", "SLURM_STEP_ID": "1"}


@pytest.mark.parametrize("procid,nodeid,localid,local_size", [
    (0, 0, 0, 2), (1, 0, 1, 2), (3, 1, 1, 2), (4, 2, 0, 1)])
def test_placement_under_srun(procid, nodeid, localid, local_size):
    p = detect_placement(_srun_env(procid, nodeid, localid))
    assert (p.rank, p.size, p.local_rank, p.local_size, p.source) == (
        procid, 5, localid, local_size, "slurm")
    # rank 0 runs on the step's first node and serves the rendezvous there
    assert p.rendezvous_addr == "node01" and p.serve_rendezvous
