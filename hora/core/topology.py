"""Where this process stands in the job: read from whichever launcher started it.

Sources, tried in order:
  hora run      HORA_RANK/HORA_SIZE/... (HOROVOD_* too) and HORA_RENDEZVOUS_ADDR/PORT
  torchrun      RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
  mpirun        OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE (Open MPI) or PMI_RANK/PMI_SIZE
  Slurm         SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_STEP_NODELIST
  SageMaker     <root>/input/config/resourceconfig.json: one rank per host (hora.core.sagemaker)
  nothing       a job of size 1

Without hora's launcher, rank 0 serves the rendezvous itself: at MASTER_ADDR:MASTER_PORT+1
under torchrun (torchrun's own store holds MASTER_PORT; the torch.distributed backend
agrees on a free port through that store instead: HORA_RENDEZVOUS_PORT), on the first node of the Slurm step
at a port derived from the job id, or at an address exchanged through mpi4py under mpirun.

The job's key, where no launcher of ours hands one out (:mod:`hora.rendezvous.keys`):
HORA_SECRET, else HORA_SECRET_FILE, else -- where every rank sees the same home directory
(Slurm; torchrun with every rank on one host) -- the per-user secret in ``~/.hora``, else a
hash of the job's public identity.  Only the last is *derivable*: ``Placement.secret_is_real``
is False, and the rendezvous and the mesh then run in their restricted mode (see
:mod:`hora.core.bootstrap`).

Layer: core.  HORA_* variables are read through hora.config only.
"""
import dataclasses
import os
import re
import socket

from .. import config
from ..errors import HoraError
from ..rendezvous.host import kernel_id, usable_cpus
from ..rendezvous.keys import (SecretUnavailable, derived_key, job_key, read_secret_file,
                               user_secret)
from .sagemaker import DEFAULT_RENDEZVOUS_PORT, read_sagemaker_env

__all__ = ["Placement", "detect_placement", "Topology", "build_topology", "expand_nodelist",
           "expand_tasks_per_node"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """What the launcher told this process before any communication."""
    rank: int
    size: int
    local_rank: int
    local_size: int
    hostname: str
    source: str                       # "hora", "torchrun", "mpirun", "slurm", "sagemaker",
                                      # "single"
    rendezvous_addr: str = None
    rendezvous_port: int = None
    serve_rendezvous: bool = False    # rank 0 hosts the store (no hora launcher)
    secret: str = None
    job_id: str = "hora"
    # False: ``secret`` is a hash of public job values that others can compute, and the
    # control plane runs restricted (plain data only, rank slots first come first served)
    secret_is_real: bool = True
    # how the key was made ("HORA_SECRET", "~/.hora/secret", ...), and for a derivable one
    # why no real secret was used; said in the log line of rank 0
    secret_note: str = None
    # elastic hora run: this worker's name in the launcher's rounds, and the round it joined
    # (see hora.core.membership); the round keys the job's registrations in the store
    elastic_id: str = None
    round: int = None


def _int(env, *names):
    for n in names:
        if env.get(n, "") != "":
            return int(env[n])
    return None


def _split_top(text):
    """Split ``text`` at the commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _expand_one(name, whole):
    """All host names of one node-list entry; bracket groups expand left to right (a Cartesian
    product, as ``rack[1-2]-n[1-2]``), keeping the zero padding of each range's low end."""
    open_at = name.find("[")
    if open_at < 0:
        if "]" in name:
            raise ValueError(f"Slurm node list {whole!r}: unmatched ']'")
        return [name]
    close_at = name.find("]", open_at)
    if close_at < 0:
        raise ValueError(f"Slurm node list {whole!r}: unmatched '['")
    prefix, body, rest = name[:open_at], name[open_at + 1:close_at], name[close_at + 1:]
    numbers = []
    for rng in body.split(","):
        lo, sep, hi = rng.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"Slurm node list {whole!r}: bad range {rng!r}")
        if not sep:
            numbers.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"Slurm node list {whole!r}: range {rng!r} runs backwards")
        numbers.extend(str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1))
    return [f"{prefix}{n}{tail}" for n in numbers for tail in _expand_one(rest, whole)]


def expand_nodelist(nodelist):
    """Expand a Slurm node list such as ``gpu[01-03,7],cpu1`` into host names, in order.

    Handles several bracket groups in one name (``r[1-2]-n[01-02]``) and suffixes after a
    group (``n[1-2]-ib``); a range keeps the width of its low end (``[08-10]`` gives ``08``,
    ``09``, ``10``), as Slurm writes them.

    Raises:
        ValueError: the list is empty or malformed (unbalanced brackets, a non-numeric or
            backwards range).
    """
    if not nodelist or not nodelist.strip():
        raise ValueError(f"Slurm node list {nodelist!r} is empty")
    hosts = []
    for part in _split_top(nodelist.strip()):
        if not part:
            raise ValueError(f"Slurm node list {nodelist!r}: empty entry")
        hosts.extend(_expand_one(part, nodelist))
    return hosts


def expand_tasks_per_node(text):
    """Expand Slurm's ``SLURM_TASKS_PER_NODE`` form ``2(x3),1`` into ``[2, 2, 2, 1]``.

    Raises:
        ValueError: the text is not of that form.
    """
    counts = []
    for part in (text or "").split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"Slurm tasks per node {text!r}: expected e.g. '2(x3),1'")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def _slurm_local_size(env):
    # srun exports the step's layout as SLURM_STEP_TASKS_PER_NODE (sbatch's job layout as
    # SLURM_TASKS_PER_NODE); this node's entry is at SLURM_NODEID.  SLURM_NTASKS_PER_NODE is
    # only there when the user asked for --ntasks-per-node.
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(name):
            counts = expand_tasks_per_node(env[name])
            node = _int(env, "SLURM_NODEID") or 0
            if node >= len(counts):
                raise HoraError(f"SLURM_NODEID={node} but {name}={env[name]!r} lists "
                                f"{len(counts)} nodes")
            return counts[node]
    ntasks_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    return int(ntasks_node) if ntasks_node.isdigit() else 1


def _job_secret(env, identity, home_shared, size):
    """``(secret, is_real, note)`` of a job with public ``identity``, where no launcher of
    ours handed out a secret.

    Args:
        home_shared: every rank sees this user's home directory (Slurm; one host), so the
            per-user secret there is the same on every rank and private to the user.

    Raises:
        HoraError: HORA_SECRET_FILE is set but unusable (others may read it, say).
    """
    secret = config.env_value("SECRET", env)
    if secret is not None:
        return secret, True, "HORA_SECRET"
    path = config.env_value("SECRET_FILE", env)
    if path is not None:
        return job_key(read_secret_file(path), *identity), True, f"HORA_SECRET_FILE={path}"
    if size == 1:
        note = "a job of one process makes no connection"
    elif not home_shared:
        note = "the ranks may not share a home directory for a per-user secret"
    else:
        try:
            home = env.get("HOME")
            return job_key(user_secret(home), *identity), True, f"{home}/.hora/secret"
        except SecretUnavailable as e:
            note = f"the per-user secret is unusable: {e}"
    return derived_key(*identity), False, note


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
    if config.env_value("ELASTIC", env) and config.env_value("ELASTIC_ID", env) is not None:
        addr = config.env_value("RENDEZVOUS_ADDR", env)
        port = config.env_value("RENDEZVOUS_PORT", env)
        if addr is None or port is None or secret is None:
            raise HoraError("HORA_ELASTIC is set but HORA_RENDEZVOUS_ADDR/PORT or HORA_SECRET "
                            "are not: start elastic jobs with `hora run --min-np ...`")
        # rank and size come from the launcher's next round (hora.core.membership)
        return Placement(-1, 0, 0, 0, host, "hora", addr, port, False, secret,
                         config.env_value("JOB_ID", env) or "hora",
                         elastic_id=config.env_value("ELASTIC_ID", env))
    if "RANK" in env and "WORLD_SIZE" in env:
        master = env.get("MASTER_ADDR", "127.0.0.1")
        port = config.env_value("RENDEZVOUS_PORT", env) or int(env.get("MASTER_PORT", 29500)) + 1
        job = env.get("TORCHELASTIC_RUN_ID", "torchrun")
        size, local_size = int(env["WORLD_SIZE"]), _int(env, "LOCAL_WORLD_SIZE") or 1
        # one host, or a Slurm allocation (srun torchrun): the ranks share a home directory
        key, real, note = _job_secret(env, (job, master, port),
                                      local_size == size or "SLURM_JOB_ID" in env, size)
        return Placement(int(env["RANK"]), size, _int(env, "LOCAL_RANK") or 0, local_size,
                         host, "torchrun", master, port, True, key, job, real, note)
    if _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK") is not None:
        job = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE") or "mpirun"
        return Placement(_int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK"),
                         _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"),
                         _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID") or 0,
                         _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS") or 1,
                         host, "mpirun", None, config.env_value("RENDEZVOUS_PORT", env), True,
                         secret, job)
    if _int(env, "SLURM_PROCID") is not None and _int(env, "SLURM_NTASKS") is not None:
        nodes = expand_nodelist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                                or "127.0.0.1")
        job = f"{env.get('SLURM_JOB_ID', '0')}.{env.get('SLURM_STEP_ID', '0')}"
        port = config.env_value("RENDEZVOUS_PORT", env) or (
            20000 + (int(env.get("SLURM_JOB_ID", "0")) * 7 + int(env.get("SLURM_STEP_ID", "0")
                                                                  or 0)) % 20000)
        key, real, note = _job_secret(env, ("slurm", job), True, int(env["SLURM_NTASKS"]))
        return Placement(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                         _int(env, "SLURM_LOCALID") or 0, _slurm_local_size(env),
                         host, "slurm", nodes[0], port, True, key, job, real, note)
    sm = read_sagemaker_env(env=env)
    if sm is not None:
        return _sagemaker_placement(sm, env)
    return Placement(0, 1, 0, 1, host, "single")


def _sagemaker_placement(sm, env):
    """SageMaker started this script once per host (no MPI, no hora launcher): one rank per
    host, in the order of the host list; rank 0 serves the rendezvous on the first host.
    Each host is a container of its own: no shared home directory for a per-user secret."""
    job = env.get("TRAINING_JOB_NAME") or "sagemaker"
    port = config.env_value("RENDEZVOUS_PORT", env) or DEFAULT_RENDEZVOUS_PORT
    key, real, note = _job_secret(env, ("sagemaker", job, *sm.hosts), False, len(sm.hosts))
    return Placement(sm.host_index, len(sm.hosts), 0, 1, sm.current_host, "sagemaker",
                     sm.hosts[0], port, True, key, job, real, note)


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
    # the ranks (this one included) that run on CPUs this rank may run on, and how many CPUs
    # those ranks may run on together (None: unknown, this host's ranks and this rank's CPUs)
    cpu_ranks: int = None
    cpus: int = None

    @property
    def crowded(self):
        """Whether more ranks than CPUs share this rank's CPUs: a waiting rank then gives its
        CPU up instead of polling.  Ranks under one kernel count together even when they
        are hosts of their own (containers, network namespaces: one machine's CPUs)."""
        if self.cpu_ranks is None:
            return self.local_size > usable_cpus()
        return self.cpu_ranks > self.cpus

    @property
    def ranks_per_cpu(self):
        """How many ranks share each of this rank's CPUs (as :attr:`crowded` counts them)."""
        if self.cpu_ranks is None:
            return self.local_size / max(1, usable_cpus())
        return self.cpu_ranks / max(1, self.cpus)


def cpu_identity():
    """This process's CPUs, for :func:`build_topology`: ``"<kernel boot id>/<affinity mask in
    hex>"``, the same boot id for every process under one running kernel; "" where either
    is unknown."""
    boot = kernel_id()
    try:
        mask = sum(1 << c for c in os.sched_getaffinity(0))
    except (OSError, AttributeError):
        return ""
    return f"{boot}/{mask:x}" if boot else ""


def build_topology(rank, entries, cpu_ids=None):
    """Topology from every rank's ``(hostname, local_rank)``, Horovod's definitions, and
    every rank's :func:`cpu_identity` (``cpu_ids``, where known).

    cross_rank: index of this rank's host among the hosts that have a rank with this
    local_rank (in order of first appearance); cross_size: the number of such hosts.
    """
    hosts = tuple(e[0] for e in entries)
    me_host, me_local = entries[rank]
    host_order = list(dict.fromkeys(hosts))
    with_my_local = [h for h in host_order
                     if any(e == (h, me_local) for e in entries)]
    per_host = {h: sum(1 for x in hosts if x == h) for h in host_order}
    cpu_ranks = cpus = None
    if cpu_ids and cpu_ids[rank]:
        boot, mask = cpu_ids[rank].split("/")
        mine = int(mask, 16)
        union, cpu_ranks = 0, 0
        for other in cpu_ids:
            if other and other.split("/")[0] == boot and int(other.split("/")[1], 16) & mine:
                cpu_ranks += 1
                union |= int(other.split("/")[1], 16)
        cpus = bin(union).count("1")
    return Topology(rank=rank, size=len(entries), local_rank=me_local,
                    local_size=per_host[me_host], cross_rank=with_my_local.index(me_host),
                    cross_size=len(with_my_local),
                    is_homogeneous=len(set(per_host.values())) == 1, hosts=hosts,
                    cpu_ranks=cpu_ranks, cpus=cpus)
