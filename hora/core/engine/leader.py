"""A host leader's side of the engine: a worker to rank 0, and rank 0's voice to its host.

In a job on several hosts, the other ranks of a host hold their control connection with the
host's leader (:func:`hora.core.links.ctrl_parents`; rank 0's host is led by its next rank),
and the leaders with rank 0, or, in a job of more hosts than HORA_CONTROL_FANOUT + 1, with a
leader above them (a tree); a job on one host of more ranks than that is led as hosts of 8
ranks would be.  Where rank 0 answers the host's board (rank 0's host, or a one-host job), a
leader passes its ranks' board nudges up to it.  A leader is a worker like any other
(:class:`~hora.core.engine.worker.WorkerSide`), and also, each step:

- reads the messages of its host's ranks and of the leaders below it and sends its parent
  what its desk makes of them (:class:`~hora.core.engine.relay.HostDesk`: the cached requests
  of every rank below in one message, the rest as they came, wrapped with their rank), once a
  step, before it runs anything; its own requests take the same way;
- passes rank 0's responses down, framed once, before it runs them itself (its host's ranks
  are partners of those collectives), and a stack question to the rank it is for;
- passes a death or an abort on, both ways, before it fails as every rank does.

Rank 0 makes no offers in such a job (:mod:`.offer`: the last rank's answer before it
asks), so none comes here.

Layer: core.
"""
from ...errors import HoraInternalError, HoraRankFailedError
from ..links import ctrl_below, ctrl_routes
from .conn import frame
from .relay import HOLD_S, HostDesk
from .worker import WorkerSide
from ..wire import Abort, Accept, Dead, Fwd, HostIds, Nudge, Req, Resp

__all__ = ["LeaderSide"]


class LeaderSide(WorkerSide):
    """A host leader (global rank ``rank``): ``conn`` to its parent, ``children``
    (``{rank: Conn}``) from its host's other ranks and the leaders below it; ``parents``:
    every rank's parent (:func:`hora.core.links.ctrl_parents`).

    Args:
        clock: the engine's monotonic clock.
        settings: :class:`hora.config.Settings`: ids wait at most HOLD_S, and at most a
            quarter of the stall inspector's warning time (HORA_STALL_CHECK_TIME_SECONDS), for
            the host's other ranks (:class:`~hora.core.engine.relay.HostDesk`): rank 0's
            warning names the ranks that did not submit, not their host.
    """

    def __init__(self, rank, conn, children, executor, clock, settings, parents,
                 nudges_up=False):
        super().__init__(conn, executor)
        self.rank = rank
        self.children = children
        self.conns = [conn, *children.values()]
        self._route = ctrl_routes(rank, parents)        # a rank below -> the child toward it
        below = ctrl_below(self._route)                 # a leader below -> every rank it gathers
        self.desk = HostDesk([rank, *(c for c in children if c not in below)],
                             min(HOLD_S, settings.stall_warning_s / 4), below)
        self._clock = clock
        self._going = []                # messages going up, sent once a step (_send_up)
        self._nudges_up = nudges_up     # a board's posts wake rank 0, not this leader

    def idle(self):
        """Nothing of its host's waits here for the other ranks."""
        return not self.desk.holding()

    def step(self, send, leaving):
        self._hear_host()
        finished = super().step(send, leaving)
        if not finished:
            self._going += self.desk.due(self._clock())
            self._send_up()
        return finished

    def _up(self, msg):
        """This rank's own request or goodbye: through the desk, as its host's ranks'."""
        desk = self.desk
        self._going += (desk.request(self.rank, msg, self._clock()) if msg.__class__ is Req
                        else desk.other(self.rank, msg))

    def _send_up(self):
        """Send the parent what the step gathered, in order, each run of HostIds of the
        same ranks as one."""
        going, self._going = self._going, []
        run = None
        for msg in going:
            if msg.__class__ is HostIds:
                if run is not None and run.ranks == msg.ranks:
                    run = HostIds(run.ranks, run.ids + msg.ids, {**run.small, **msg.small})
                    continue
                if run is not None:
                    self.conn.send(run)
                run = msg
                continue
            if run is not None:
                self.conn.send(run)
                run = None
            self.conn.send(msg)
        if run is not None:
            self.conn.send(run)

    def _follow(self):
        self._send_up()                 # first: the host's requests, before running anything
        return super()._follow()

    def _hear_host(self):
        """Read the host's ranks' messages; what they come to waits for :meth:`_send_up`."""
        now, desk, going = self._clock(), self.desk, self._going
        for rank, conn in self.children.items():
            for msg in conn.receive():
                cls = msg.__class__
                if cls is Req:
                    going.extend(desk.request(rank, msg, now))
                elif cls is HostIds:        # a leader below: what its desk made
                    going.extend(desk.host(rank, msg, now))
                elif cls is Fwd:
                    going.extend(desk.forwarded(rank, msg))
                elif cls is Dead:
                    raise HoraRankFailedError(msg.text, rank=msg.rank)
                elif cls is Accept:
                    raise HoraInternalError(f"rank {rank} accepted an offer, which rank 0 "
                                            f"makes to no rank behind a host leader")
                elif cls is Nudge:          # a post on this host's board waits
                    if self._nudges_up:         # (rank 0 answers it; else arriving woke us)
                        self.conn.send(msg)
                else:
                    going.extend(desk.other(rank, msg))

    def _down(self, msg):
        """Send every rank of the host ``msg``, framed once."""
        data = frame(msg)
        for conn in self.children.values():
            conn.send_frame(data)

    def _take(self, msg):
        cls = msg.__class__
        if cls is Resp:
            self.desk.heard(msg.responses)
            self._down(msg)                 # first: the host's ranks run them with this one
        elif cls is Fwd:                    # a stack question for a rank below
            child = self._route[msg.src]
            self.children[child].send(msg.body if child == msg.src else msg)
            return False
        elif cls is Dead or cls is Abort:
            self._down(msg)
        return super()._take(msg)
