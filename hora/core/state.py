"""The job's context and the questions about it (rank, size, ...).

One job per process at a time.  :mod:`hora.core.lifecycle` forms it (``init()``) and ends it
(``shutdown()``); this module only holds it and answers from it.  Layer: core, its bottom:
it imports nothing of hora.core, so that every module may ask (process sets, stats, ops,
objects, the bindings) without importing what forms the job.
"""
from ..errors import NotInitializedError

__all__ = ["is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
           "cross_size", "is_homogeneous", "engine", "topology", "transport"]

_ctx = None


class _Context:
    def __init__(self, job, engine, settings, placement, member_client=None):
        self.job = job
        self.engine = engine
        self.settings = settings
        self.placement = placement
        self.member_client = member_client      # elastic: asks the launcher for news


def _begin(ctx):
    """init(): ``ctx`` is the job now."""
    global _ctx
    _ctx = ctx


def _end():
    """shutdown(): no job from now on; returns the one there was (None if none)."""
    global _ctx
    ctx, _ctx = _ctx, None
    return ctx


def is_initialized() -> bool:
    """True between init() and shutdown()."""
    return _ctx is not None


def _require():
    ctx = _ctx
    if ctx is None:
        raise NotInitializedError("hora")
    return ctx


def engine():
    return _require().engine


def topology():
    return _require().job.topology


def transport():
    """The job's transport (its connections to peers: ``transport().peers``)."""
    return _require().job.transport


def rank() -> int:
    """This process's rank in the job (0 .. size-1)."""
    return topology().rank


def size() -> int:
    """Number of processes in the job."""
    return topology().size


def local_rank() -> int:
    """Rank among the processes on this host."""
    return topology().local_rank


def local_size() -> int:
    """Number of processes on this host."""
    return topology().local_size


def cross_rank() -> int:
    """Index of this host among the hosts that run a process with this local rank."""
    return topology().cross_rank


def cross_size() -> int:
    """Number of hosts that run a process with this local rank."""
    return topology().cross_size


def is_homogeneous() -> bool:
    """True when every host runs the same number of processes."""
    return topology().is_homogeneous
