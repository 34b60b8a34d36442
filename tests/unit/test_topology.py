"""Placement from each launcher's environment, and Horovod's cross-rank definitions."""
import os

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


def test_ranks_under_one_kernel_share_its_cpus_whatever_their_hosts():
    """Two "hosts" of 2 ranks under one kernel (network namespaces, containers) with the
    same 2 CPUs are 4 ranks on 2 CPUs: crowded; disjoint CPU sets (pinned containers) are
    not; another kernel (another boot id) never counts; unknown identities fall back to
    this host's ranks against this process's CPUs."""
    entries = [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    boot, other = "0f" * 8, "1e" * 8
    same = [f"{boot}/3"] * 4
    t = build_topology(2, entries, same)
    assert (t.local_size, t.cpu_ranks, t.cpus, t.crowded) == (2, 4, 2, True)
    pinned = [f"{boot}/3", f"{boot}/3", f"{boot}/c", f"{boot}/c"]
    t = build_topology(2, entries, pinned)
    assert (t.cpu_ranks, t.cpus, t.crowded) == (2, 2, False)
    overlap = [f"{boot}/1", f"{boot}/3", f"{boot}/2", f"{boot}/f"]   # rank 0: cpu 0 only
    t = build_topology(0, entries, overlap)
    assert (t.cpu_ranks, t.cpus, t.crowded) == (3, 4, False)
    t = build_topology(3, entries, overlap)
    assert (t.cpu_ranks, t.cpus, t.crowded) == (4, 4, False)
    machines = [f"{boot}/3", f"{boot}/3", f"{other}/3", f"{other}/3"]
    assert not build_topology(0, entries, machines).crowded
    t = build_topology(0, entries, ["", "", "", ""])
    assert t.cpu_ranks is None and t.crowded == (2 > len(os.sched_getaffinity(0)))


def test_this_process_cpu_identity():
    from hora.core.topology import cpu_identity
    boot, mask = cpu_identity().split("/")
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert boot == f.read().strip()
    assert {c for c in range(4096) if int(mask, 16) >> c & 1} == os.sched_getaffinity(0)


# -- the job key outside `hora run` ----------------------------------------------------------
import hashlib  # noqa: E402
import stat  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from hora.errors import HoraError  # noqa: E402


def _torchrun_env(rank, local_world_size, **extra):
    return dict({"RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank % 2),
                 "LOCAL_WORLD_SIZE": str(local_world_size), "MASTER_ADDR": "node1",
                 "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"}, **extra)


def _slurm_env(rank, **extra):
    return dict({"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
                 "SLURM_NTASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "node1",
                 "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}, **extra)


def test_torchrun_across_hosts_without_a_secret_has_a_derivable_key(tmp_path):
    p = detect_placement(_torchrun_env(2, 2, HOME=str(tmp_path)))
    assert not p.secret_is_real and "home directory" in p.secret_note
    # anyone can compute it from the run id, MASTER_ADDR and the port: that is the point
    assert p.secret == hashlib.sha256(b"none|node1|29501").hexdigest()
    assert not (tmp_path / ".hora").exists()


def test_torchrun_on_one_host_and_slurm_use_the_per_user_secret(tmp_path):
    keys = {detect_placement(_torchrun_env(r, 4, HOME=str(tmp_path))).secret for r in range(4)}
    assert len(keys) == 1                              # every rank agrees
    p = detect_placement(_torchrun_env(0, 4, HOME=str(tmp_path)))
    assert p.secret_is_real and p.secret_note.endswith(".hora/secret")
    assert p.secret != hashlib.sha256(b"none|node1|29501").hexdigest()
    assert stat.S_IMODE((tmp_path / ".hora").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / ".hora" / "secret").stat().st_mode) == 0o600
    slurm = [detect_placement(_slurm_env(r, HOME=str(tmp_path))) for r in range(2)]
    assert slurm[0].secret == slurm[1].secret and slurm[0].secret_is_real
    assert slurm[0].secret not in keys                 # one user's jobs have separate keys
    other = detect_placement(_slurm_env(0, HOME=str(tmp_path), SLURM_JOB_ID="4243"))
    assert other.secret != slurm[0].secret


def test_the_per_user_secret_is_made_once_when_ranks_race_for_it(tmp_path):
    code = ("import sys; from hora.rendezvous.keys import user_secret; "
            "print(user_secret(sys.argv[1]).hex())")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True) for _ in range(8)]
    outs = {p.communicate(timeout=30)[0].strip() for p in procs}
    assert len(outs) == 1 and len(outs.pop()) == 64
    assert os.listdir(tmp_path / ".hora") == ["secret"]      # no temporary file left


def test_a_per_user_secret_others_could_read_is_not_used(tmp_path):
    (tmp_path / ".hora").mkdir(mode=0o755)
    os.chmod(tmp_path / ".hora", 0o755)
    p = detect_placement(_slurm_env(0, HOME=str(tmp_path)))
    assert not p.secret_is_real and "0755" in p.secret_note
    assert not (tmp_path / ".hora" / "secret").exists()     # never repaired behind the user
    p = detect_placement(_slurm_env(0))                    # no HOME at all
    assert not p.secret_is_real and "home directory" in p.secret_note


def test_hora_secret_and_a_private_secret_file_win(tmp_path):
    p = detect_placement(_torchrun_env(1, 2, HORA_SECRET="correct horse battery staple"))
    assert p.secret_is_real and p.secret == "correct horse battery staple"
    path = tmp_path / "job.secret"
    path.write_text("s3cret\n")
    os.chmod(path, 0o600)
    keys = [detect_placement(_torchrun_env(r, 2, HORA_SECRET_FILE=str(path))) for r in range(2)]
    assert keys[0].secret == keys[1].secret and keys[0].secret_is_real
    assert "HORA_SECRET_FILE" in keys[0].secret_note


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o602])
def test_a_secret_file_others_may_read_or_write_is_refused(tmp_path, mode):
    path = tmp_path / "job.secret"
    path.write_text("s3cret\n")
    os.chmod(path, mode)
    with pytest.raises(HoraError, match=f"mode {mode:04o}.*chmod 600"):
        detect_placement(_torchrun_env(1, 2, HORA_SECRET_FILE=str(path)))
    with pytest.raises(HoraError, match="cannot open"):
        detect_placement(_torchrun_env(1, 2, HORA_SECRET_FILE=str(tmp_path / "missing")))
