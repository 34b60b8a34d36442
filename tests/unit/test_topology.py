"""Placement from each launcher's environment, and Horovod's cross-rank definitions."""
import pytest

from hora.core.topology import build_topology, detect_placement, expand_nodelist


def test_no_launcher_is_a_job_of_one():
    p = detect_placement({})
    assert (p.rank, p.size, p.local_rank, p.local_size, p.source) == (0, 1, 0, 1, "single")


@pytest.mark.parametrize("prefix", ["HORA_", "HOROVOD_"])
def test_hora_run_contract_and_horovod_aliases(prefix):
    env = {f"{prefix}RANK": "3", f"{prefix}SIZE": "4", f"{prefix}LOCAL_RANK": "1",
           f"{prefix}LOCAL_SIZE": "2", f"{prefix}RENDEZVOUS_ADDR": "10.0.0.1",
           f"{prefix}RENDEZVOUS_PORT": "1234", f"{prefix}SECRET": "ab" * 32}
    p = detect_placement(env)
    assert (p.rank, p.size, p.local_rank, p.local_size) == (3, 4, 1, 2)
    assert (p.rendezvous_addr, p.rendezvous_port, p.source) == ("10.0.0.1", 1234, "hora")
    assert not p.serve_rendezvous


def test_hora_names_win_over_horovod_names():
    env = {"HORA_RANK": "1", "HOROVOD_RANK": "0", "HORA_SIZE": "1"}
    assert detect_placement(env).rank == 1


def test_torchrun():
    env = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "node1", "MASTER_PORT": "29500"}
    p = detect_placement(env)
    assert (p.rank, p.size, p.local_rank, p.local_size, p.source) == (2, 4, 0, 2, "torchrun")
    assert (p.rendezvous_addr, p.rendezvous_port, p.serve_rendezvous) == ("node1", 29501, True)
    assert p.secret


def test_open_mpi():
    env = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    p = detect_placement(env)
    assert (p.rank, p.size, p.local_rank, p.local_size, p.source) == (5, 8, 1, 4, "mpirun")


def test_slurm():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
           "SLURM_NTASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "gpu[07-08]",
           "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}
    p = detect_placement(env)
    assert (p.rank, p.size, p.local_rank, p.local_size, p.source) == (3, 4, 1, 2, "slurm")
    assert p.rendezvous_addr == "gpu07" and p.serve_rendezvous


def test_slurm_nodelists():
    assert expand_nodelist("a[01-03,7],b1") == ["a01", "a02", "a03", "a7", "b1"]
    assert expand_nodelist("host") == ["host"]
    assert expand_nodelist("n[9-11]-ib") == ["n9-ib", "n10-ib", "n11-ib"]


def test_cross_rank_on_uneven_hosts():
    # host a runs local ranks 0,1; host b runs local rank 0 only
    entries = [("a", 0), ("a", 1), ("b", 0)]
    t0, t1, t2 = (build_topology(r, entries) for r in range(3))
    assert (t0.cross_rank, t0.cross_size, t0.local_size) == (0, 2, 2)
    assert (t1.cross_rank, t1.cross_size, t1.local_size) == (0, 1, 2)
    assert (t2.cross_rank, t2.cross_size, t2.local_size) == (1, 2, 1)
    assert not t0.is_homogeneous
    assert build_topology(0, [("a", 0), ("b", 0)]).is_homogeneous
