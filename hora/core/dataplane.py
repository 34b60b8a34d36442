"""Which backend carries each rank's large collectives: HORA_BACKEND and the topology.

- ``tcp``: the ring (and direct exchanges) over the job's TCP mesh, everywhere.
- ``shm``: shared memory among the ranks of one host; the job must fit on one host.
- ``hierarchical``: shared memory inside each host, the TCP ring between hosts; needs the
  same number of ranks on every host.
- ``auto`` (default): shm when every rank is on one host, hierarchical when the job spans
  several hosts with several ranks each (and is homogeneous), else tcp.
- ``gloo``: torch.distributed's gloo process group over every rank (``hora[torch]``).
- ``mpi``: MPI through mpi4py, for a job started by mpirun or ``hora run --mpi``
  (``hora[mpi]``).
- ``nccl``: CUDA tensors through NCCL where they live (a *device plane*,
  :mod:`hora.backends.nccl`); host buffers as with ``auto``.

A data plane is a :class:`hora.backends.base.Plane`: ``allreduce``, ``reducescatter``,
``allgather``, ``broadcast`` and ``alltoall`` on flat numpy buffers, each returning False
when it declines that call (the engine then runs the TCP algorithms,
:class:`hora.backends.ring.RingPlane`); it serves the global process set, and buffers above
ring.SMALL (smaller ones are latency-bound and take the direct paths).
A device plane takes the framework's tensors themselves (device arrays, see
:func:`hora.core.ops._device`) for allreduce, broadcast and allgather of the global set.
Layer: core.
"""
import logging
import mmap

from ..errors import HoraError

__all__ = ["BACKENDS", "check_backend", "make_board", "make_device_planes", "make_plane",
           "spin_budget"]

log = logging.getLogger(__name__)

from ..config import BACKENDS  # noqa: E402,F401 - declared with HORA_BACKEND


def check_backend(name, topo, source=None):
    """Raise HoraError, on every rank alike, if backend ``name`` cannot serve this job
    (``source``: the placement's launcher, "mpirun" when mpirun started it)."""
    if name not in BACKENDS:
        raise HoraError(f"HORA_BACKEND={name!r}: expected one of {', '.join(BACKENDS)}")
    if name == "gloo":
        from ..backends.gloo import require_torch
        require_torch()
    if name == "nccl" and topo.size > 1:
        from ..backends.nccl import require_nccl
        require_nccl()
    if name == "mpi" and topo.size > 1:
        if source != "mpirun":
            raise HoraError(f"HORA_BACKEND=mpi needs a job started by mpirun (or `hora run "
                            f"--mpi`), where hora's ranks are MPI's; this job's ranks come "
                            f"from {source or 'another launcher'} (use gloo, auto or tcp)")
        from ..backends.mpi import require_mpi4py
        require_mpi4py()
    if name == "shm" and topo.local_size != topo.size:
        raise HoraError(f"HORA_BACKEND=shm needs every rank on one host; this job spans "
                        f"{len(set(topo.hosts))} hosts (use auto, hierarchical or tcp)")
    if name == "hierarchical" and not topo.is_homogeneous:
        counts = {h: topo.hosts.count(h) for h in dict.fromkeys(topo.hosts)}
        raise HoraError(f"HORA_BACKEND=hierarchical needs the same number of ranks on every "
                        f"host; this job has {counts} (use auto or tcp)")


def make_plane(settings, transport, topo):
    """The data plane for this job, or None for plain TCP (a collective call on every
    rank: the hierarchical plane agrees on shared memory with every other rank)."""
    # the planes are imported here, not at the top: the launcher reads BACKENDS and must
    # not pay for NumPy (and torch, mpi4py) at start-up
    from ..backends.gloo import GlooGroup
    from ..backends.hierarchical import Hierarchical
    from ..backends.mpi import MpiGroup
    from ..backends.shm import ShmGroup
    name, slot = settings.backend, settings.shm_slot_bytes
    if name == "nccl":
        name = "auto"               # nccl is for device tensors; host buffers as auto
    if topo.size == 1 or name == "tcp":
        return None
    if name == "gloo":
        return GlooGroup(transport, settings.start_timeout, settings.transport_timeout)
    if name == "mpi":
        return MpiGroup(topo.rank, topo.size)
    # a shared-memory barrier polls without sleeping for a moment, as a waiting caller does
    spin = spin_budget(settings, topo)
    if topo.local_size == topo.size:
        plane = ShmGroup(transport, slot, cma_reads=settings.shm_cma)
        plane.spin_s = spin
        return plane
    if name == "shm":
        raise HoraError("HORA_BACKEND=shm needs every rank on one host")
    if topo.local_size == 1 or not topo.is_homogeneous:
        if name == "hierarchical":
            check_backend(name, topo)
        return None             # auto: one rank per host (or uneven hosts): the flat ring
    plane = Hierarchical(transport, topo.hosts, slot, settings.hierarchical_piece_bytes,
                         cma_reads=settings.shm_cma)
    plane.spin_s = spin
    if plane.agree():
        if topo.rank == 0:
            log.info("hierarchical allreduce: shared memory inside %d hosts of %d ranks, "
                     "TCP between them", len(set(topo.hosts)), topo.local_size)
        return plane
    plane.close()
    if topo.rank == 0:
        log.warning("shared memory is unavailable on some host: using the TCP ring")
    return None


def make_board(settings, transport, topo, plane):
    """This host's board of blocking small allreduces (:mod:`hora.core.engine.board`), or
    None: a collective call on every rank.  Where the shared-memory plane serves the job
    (every rank on this host), or the hierarchical one (shared memory in each host: a board
    per host, whose leaders meet through rank 0), or, with ``auto``, a job on several hosts
    that the TCP ring serves (one rank a host, or hosts of different sizes): a board per
    host all the same (a host of one rank keeps its board in its own memory), so that a
    small call takes one message from each host instead of a request to rank 0 and its
    answer; and this machine orders stores as the board needs; and the job's leaders all
    connect to rank 0 (at most HORA_CONTROL_FANOUT + 1 hosts)."""
    from ..backends.board_segment import board_bytes, board_limit, supported
    from .engine.board import Board
    kind = getattr(plane, "name", None)
    # (topology and settings are the same on every rank: so is this)
    hosts = len(set(topo.hosts))
    ring = kind is None and settings.backend == "auto" and hosts > 1
    # every leader hears every other's host posts, through rank 0, which has at most
    # HORA_CONTROL_FANOUT leaders connected to it (hora.core.links.ctrl_parents).  More hosts,
    # no boards: passing each post on across a tree of leaders cost more than the engine,
    # whose leaders add up their hosts' small inputs on the way to rank 0 (docs/scale.md)
    if (topo.size == 1 or not settings.shm_board or hosts > settings.control_fanout + 1
            or not (ring or kind in ("shm", "hierarchical")) or not supported()):
        return None
    from ..backends.shm import shared_segment, shm_bytes, vote
    limit = board_limit(shm_bytes())
    if kind == "shm":
        mapping = shared_segment(transport, board_bytes(topo.size, limit), "board")
        return None if mapping is None else Board(
            mapping, topo.rank, topo.size, spin_budget(settings, topo), topo.crowded,
            settings.transport_timeout, limit=limit)
    from ..backends.group import SubsetTransport
    order = list(dict.fromkeys(topo.hosts))
    local = [r for r, h in enumerate(topo.hosts) if h == topo.hosts[topo.rank]]
    if len(local) == 1:         # nobody to share it with
        mapping = mmap.mmap(-1, board_bytes(1, limit))
    else:
        mapping = shared_segment(SubsetTransport(transport, local),
                                 board_bytes(len(local), limit), "board")
    if not vote(transport, mapping is not None):   # every host has its board, or none does
        return None
    leaders = [topo.hosts.index(h) for h in order]
    return Board(mapping, local.index(topo.rank), len(local), spin_budget(settings, topo),
                 topo.crowded, settings.transport_timeout, leaders, topo.size, limit)


def make_device_planes(settings, transport, topo):
    """``{device type: device plane}`` for this job (a collective call on every rank):
    ``{"cuda": NCCL}`` with HORA_BACKEND=nccl, else none (device tensors are staged through
    host memory)."""
    if settings.backend != "nccl" or topo.size == 1:
        return {}
    from ..backends.nccl import TensorGroup
    return {"cuda": TensorGroup(transport, "cuda", settings.start_timeout,
                                settings.transport_timeout, topo.local_rank)}


# ranks a CPU beyond which a waiter on shared memory sleeps at once: yielding the CPU to
# that many peers in turn costs them more than it saves (a 4 B board allreduce of 32 and 64
# ranks on 2 CPUs took a third of the time when its waiters slept at once; at 8 ranks a CPU
# and fewer, yielding first is the quicker)
CROWD_SPIN_MAX = 8


def spin_budget(settings, topo=None):
    """Seconds a waiting thread may poll without sleeping (HORA_SPIN_TIME_US); where more
    ranks than CPUs share this rank's CPUs (Topology.crowded) it yields the CPU between two
    looks, which a peer may need to make the progress waited for; where more than
    CROWD_SPIN_MAX ranks share each of ``topo``'s CPUs, none."""
    if topo is not None and topo.ranks_per_cpu > CROWD_SPIN_MAX:
        return 0.0
    return settings.spin_time_us / 1e6
