"""Which side of the control plane a rank plays, over which of its connections.

Rank 0 coordinates (:mod:`.coordinator`); a rank whose host's ranks, or leaders below it,
connect to it is a leader (:mod:`.leader`); any other rank is a worker (:mod:`.worker`).
Each control connection becomes a :class:`.conn.Conn`.

Layer: core.
"""
from ..links import ctrl_parents
from .conn import Conn
from .coordinator import CoordinatorSide
from .leader import LeaderSide
from .worker import WorkerSide

__all__ = ["control_side"]


def control_side(rank, size, ctrl, executor, settings, clock, set_cycle, hosts, plain_only,
                 kept, nudges_up=False):
    """``(side, down)``: this rank's side over its control connections (``ctrl``, a
    :class:`hora.core.bootstrap.Ctrl`), and ``{rank: Conn}`` of those that come to it.
    ``kept`` is called when a data read on a connection that carries its pair's data too
    (:mod:`hora.backends.mux`) kept control messages there for the next step: the socket
    no longer shows them.  ``nudges_up``: this rank has a board whose posts a rank above it
    answers (rank 0's host's, or a one-host job's led in groups): as a leader it passes
    its ranks' nudges up."""
    timeout = settings.transport_timeout
    down = {r: Conn(s, r, timeout, plain_only) for r, s in ctrl.down.items()}
    if rank == 0:
        side = CoordinatorSide(size, down, executor, settings, clock, set_cycle, hosts)
    else:
        up = Conn(ctrl.up, ctrl.parent, timeout, plain_only)
        side = (LeaderSide(rank, up, down, executor, clock, settings,
                           ctrl_parents(hosts, settings.control_fanout), nudges_up) if down
                else WorkerSide(up, executor))
    for conn in side.conns:
        shared = getattr(conn.sock, "shared", None)
        if shared is not None:
            shared.notify = kept
    return side, down
