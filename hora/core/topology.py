"""Where this process stands in the job: read from whichever launcher started it.

Sources, tried in order:
  hora run      HORA_RANK/HORA_SIZE/... (HOROVOD_* too) and HORA_RENDEZVOUS_ADDR/PORT
  torchrun      RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
  mpirun        OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE (Open MPI) or PMI_RANK/PMI_SIZE
  Slurm         SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_STEP_NODELIST
  nothing       a job of size 1

Without hora's launcher, rank 0 serves the rendezvous itself: at MASTER_ADDR:MASTER_PORT+1
under torchrun (torchrun's own store holds MASTER_PORT), on the first node of the Slurm step
at a port derived from the job id, or at an address exchanged through mpi4py under mpirun.

Layer: core.  HORA_* variables are read through hora.config only.
"""
import dataclasses
import os
import re
import socket

from .. import config
from ..errors import HoraError

__all__ = ["Placement", "detect_placement", "Topology", "build_topology", "expand_nodelist"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """What the launcher told this process before any communication."""
    rank: int
    size: int
    local_rank: int
    local_size: int
    hostname: str
    source: str                       # "hora", "torchrun", "mpirun", "slurm", "single"
    rendezvous_addr: str = None
    rendezvous_port: int = None
    serve_rendezvous: bool = False    # rank 0 hosts the store (no hora launcher)
    secret: str = None
    job_id: str = "hora"


def _int(env, *names):
    for n in names:
        if env.get(n, "") != "":
            return int(env[n])
    return None


def expand_nodelist(nodelist):
    """Expand a Slurm node list such as ``gpu[01-03,7],cpu1`` into host names."""
    hosts = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        m = re.match(r"^(.*?)\[([^\]]*)\](.*)$", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for rng in ranges.split(","):
            if "-" in rng:
                lo, hi = rng.split("-", 1)
                for i in range(int(lo), int(hi) + 1):
                    hosts.append(f"{prefix}{str(i).zfill(len(lo))}{suffix}")
            else:
                hosts.append(f"{prefix}{rng}{suffix}")
    return hosts


def _derived_secret(*parts):
    # Outside hora's launcher no secret is handed out; one derived from the job's identity
    # keeps separate jobs apart.  HORA_SECRET set by the user gives a real secret.
    import hashlib
    return hashlib.sha256("|".join(str(p) for p in parts).encode()).hexdigest()


def detect_placement(env=None):
    """Read this process's placement from the environment its launcher set."""
    env = os.environ if env is None else env
    host = config.env_value("HOSTNAME", env) or socket.gethostname()
    secret = config.env_value("SECRET", env)
    rank = config.env_value("RANK", env)
    size = config.env_value("SIZE", env)
    if rank is not None and size is not None:
        addr = config.env_value("RENDEZVOUS_ADDR", env)
        port = config.env_value("RENDEZVOUS_PORT", env)
        if size > 1 and (addr is None or port is None):
            raise HoraError("HORA_RANK/HORA_SIZE are set but HORA_RENDEZVOUS_ADDR/PORT are "
                            "not: start the job with `hora run`")
        return Placement(rank, size, config.env_value("LOCAL_RANK", env) or 0,
                         config.env_value("LOCAL_SIZE", env) or 1, host, "hora", addr, port,
                         False, secret, config.env_value("JOB_ID", env) or "hora")
    if "RANK" in env and "WORLD_SIZE" in env:
        master = env.get("MASTER_ADDR", "127.0.0.1")
        port = config.env_value("RENDEZVOUS_PORT", env) or int(env.get("MASTER_PORT", 29500)) + 1
        job = env.get("TORCHELASTIC_RUN_ID", "torchrun")
        return Placement(int(env["RANK"]), int(env["WORLD_SIZE"]), _int(env, "LOCAL_RANK") or 0,
                         _int(env, "LOCAL_WORLD_SIZE") or 1, host, "torchrun", master, port,
                         True, secret or _derived_secret(job, master, port), job)
    if _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK") is not None:
        job = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE") or "mpirun"
        return Placement(_int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK"),
                         _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"),
                         _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID") or 0,
                         _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS") or 1,
                         host, "mpirun", None, None, True, secret, job)
    if _int(env, "SLURM_PROCID") is not None and _int(env, "SLURM_NTASKS") is not None:
        nodes = expand_nodelist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                                or "127.0.0.1")
        job = f"{env.get('SLURM_JOB_ID', '0')}.{env.get('SLURM_STEP_ID', '0')}"
        port = config.env_value("RENDEZVOUS_PORT", env) or (
            20000 + (int(env.get("SLURM_JOB_ID", "0")) * 7 + int(env.get("SLURM_STEP_ID", "0")
                                                                  or 0)) % 20000)
        ntasks_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        return Placement(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                         _int(env, "SLURM_LOCALID") or 0,
                         int(ntasks_node) if ntasks_node.isdigit() else
                         (_int(env, "SLURM_TASKS_PER_NODE") or 1),
                         host, "slurm", nodes[0], port, True,
                         secret or _derived_secret("slurm", job), job)
    return Placement(0, 1, 0, 1, host, "single")


@dataclasses.dataclass(frozen=True)
class Topology:
    """The job's shape, known after every rank has registered."""
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    is_homogeneous: bool
    hosts: tuple                     # hostname of each rank


def build_topology(rank, entries):
    """Topology from every rank's ``(hostname, local_rank)``, Horovod's definitions.

    cross_rank: index of this rank's host among the hosts that have a rank with this
    local_rank (in order of first appearance); cross_size: the number of such hosts.
    """
    hosts = tuple(e[0] for e in entries)
    me_host, me_local = entries[rank]
    host_order = list(dict.fromkeys(hosts))
    with_my_local = [h for h in host_order
                     if any(e == (h, me_local) for e in entries)]
    per_host = {h: sum(1 for x in hosts if x == h) for h in host_order}
    return Topology(rank=rank, size=len(entries), local_rank=me_local,
                    local_size=per_host[me_host], cross_rank=with_my_local.index(me_host),
                    cross_size=len(with_my_local),
                    is_homogeneous=len(set(per_host.values())) == 1, hosts=hosts)
