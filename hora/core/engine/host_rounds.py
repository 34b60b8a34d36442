"""Host rounds: the boards of a job on several hosts, settled among their leaders.

Every host has a board of its own (:mod:`.board`), whose rank 0 is the host's *leader* (its
lowest rank; global rank 0 leads the first host), for the calls below STRIPE_BYTES.  A job on
several hosts whose data plane is the TCP ring (one rank a host, or hosts of different sizes)
has them too; a host of one rank keeps a board of one in its own memory, and its host's
partial result is its own input.  The leaders play *host rounds*, numbered alike on every
leader.  A leader waits for its host's posts as rank 0 does on one host, reduces them in rank
order and sends every other leader the host's partial result in a
:class:`~hora.core.wire.HostPost` of the round (rank 0 sends its own to each leader, and
relays each leader's to the others: the only control connections are with rank 0); when
every leader has posted the same collective, each adds the hosts' partials in host order (the
same bits everywhere), applies the postscale and answers its host's posts (*result*: the
result is in the host's result area).  One message from each leader, sent at once, and no
answer to wait for: the hosts settle a round in one network latency, not the two of a
request to rank 0 and its answer.

A leader that posted a round is committed to it; one that has not may *veto* it instead (an
empty HostPost, which names the leader's own call when it is in one), and must
(:func:`.board_rules.leader_verdict`) when it is busy, when its host's posts differ or did
not all come within PATIENCE_S, when another leader vetoed the round, or when another leader
urges it to: a leader whose round waited PATIENCE_S for the others says so, and so does rank
0 as soon as its engine has work under way.  A vetoed round (or one whose posts differ) sends
every host's posts of it to the engine, on every host alike.  A leader outside a board call
vetoes, from its engine's steps, a round another leader posted when it is busy or urged, or
after PATIENCE_S (:func:`.board_rules.idle_verdict`); a round vetoed meanwhile is over for it
too, and its host's ranks send that round's collective (named by a post or by the veto) to
the engine when they come to it.

Layer: core.
"""
import os
import select

from ...errors import CollectiveTimeoutError
from ..messages import BARRIER
from ..wire import HostPost
from .board import RESULT
from .board_port import DONE, ENGINE, passed
from .board_rules import PATIENCE_S, idle_verdict, leader_verdict, round_outcome, waited

__all__ = ["HostRounds"]

STEP_S = 50e-6              # a leader waiting for its host or the others steps its engine
#                             this often: it hears the sockets (a dead peer) within a few looks
NAP_S = 2e-3                # a leader waiting for the other leaders sleeps this long at most
RETREATS_KEPT = 64          # signatures the other hosts sent to the engine, remembered


class HostRounds:
    """A host's leader's side of the host rounds (``rank``: its global rank), on ``board``,
    through the engine's ``port`` (:class:`.board_port.Port`); ``calls``: the
    :class:`.board_calls.BoardCalls` it serves (its counts)."""

    def __init__(self, board, port, calls, rank):
        self.board, self.port, self.calls, self.rank = board, port, calls, rank
        self.leaders = tuple(r for r in board.leaders if r != rank)  # the others, host order
        side = port.side
        if rank == 0:
            side.relay = self.leaders
        # the control sockets a leader hears the other leaders' host posts on
        self._ctrl_fds = ([c.fileno() for c in side.conns] if rank == 0
                          else [side.conn.fileno()])
        self._leader_fds = ({side.workers[r].fileno() for r in self.leaders} if rank == 0
                            else set(self._ctrl_fds))
        self._round = 0                     # host rounds played so far
        self._round_seen = {}               # when the next round was first seen posted
        self._round_ended = 0.0             # when the last one ended
        self._retreats = set()              # signatures the other hosts sent to the engine
        self._held_back = False             # a call left messages in a connection

    # -- a call of this leader -------------------------------------------------------------
    def call(self, req, arrays, sig, size):
        """The leader in a board call: wait for the host's posts, then play the next host
        round (:meth:`_play`), unless it vetoes the round first.  Returns ``(DONE, flat)``
        or ENGINE, as :meth:`.board_calls.BoardCalls.settle` takes them."""
        board, port = self.board, self.port
        clock = port.clock
        started = last_step = clock()
        workers = board.size - 1
        k = self._round + 1
        # after a pause, read what came meanwhile first: a leader that has waited for this
        # round longer than PATIENCE_S asks for its veto (_urged)
        if started - self._round_ended > PATIENCE_S / 2 and port.step():
            return passed("stopped")
        if sig in self._retreats:       # the other hosts sent it to the engine meanwhile
            self._retreats.discard(sig)
            return passed("retreat", board, board.open_posts())
        heard = True                    # the sockets were read since the last look at them
        while True:
            bell = board.bell()
            posts = board.open_posts()
            now = clock()
            vetoed = urged = busy = None
            if heard:                   # (only a step changes what was heard, or busy())
                heard = False
                if port.side.host_msgs:     # (empty when the others have not gone ahead)
                    vetoed = any(not m.sig for m in self._round_msgs(k).values())
                    urged = self._urged(k)
                busy = port.busy()
            verdict = leader_verdict(vetoed, urged, busy, len(posts) == workers,
                                     lambda: board.matches(posts, sig, size), now - started)
            if verdict is True:
                return self._play(req, arrays, posts, sig, size, k, started)
            if verdict is not None:     # (a round another vetoed needs no veto of its own)
                return self._veto(posts, k, verdict, sig, send=verdict != "vetoed")
            if now - last_step > STEP_S:    # hear the sockets (the other leaders)
                last_step, heard = now, True
                if port.step():
                    return passed("stopped", board, board.open_posts())
            board.pause(started, now, bell, board.missing)

    def lane_call(self, lane, a):
        """A leader's side of a lane's call: RESULT, or what :meth:`call` returns first.
        When every post of its host is in and is the lane's call, and nothing but the other
        leaders' posts of the next round was heard meanwhile, it plays that round at once:
        :meth:`call` would find nothing to wait for and nothing to veto."""
        k = self._round + 1
        now = self.port.clock()
        posts = lane.open_posts()
        if (posts is not None and now - self._round_ended <= PATIENCE_S / 2
                and lane.sig not in self._retreats and not self.port.busy()
                and all(key[1] == k and m.sig for key, m in self.port.side.host_msgs.items())):
            got = self._play(lane.req, [a], posts, lane.sig, lane.nbytes, k, now)
        else:
            got = self.call(lane.req, [a], lane.sig, lane.nbytes)
        return RESULT if got.__class__ is tuple else got

    def after_call(self):
        """After a call: messages of other kinds held back meanwhile get an engine step (no
        socket would wake the engine for them: their bytes have been read)."""
        if self._held_back:
            self._held_back = False
            self.port.step()

    def _play(self, req, arrays, posts, sig, size, k, started):
        """Host round ``k`` of a leader whose host has posted ``sig``: send every other
        leader this host's partial result (rank 0 relays a leader's to the others), wait for
        theirs, and, when every leader posted ``sig``, add the hosts' partials in host order,
        the same bits on every host, into the host's result area; otherwise (a veto, another
        collective) every leader sends its host to the engine."""
        board, port = self.board, self.port
        mine = b"" if req.kind == BARRIER else board.partial(req, arrays, size)
        self._send_round(k, sig, mine)
        need = len(self.leaders)
        # (steps from now on: the wait for the host's posts took its own, and a step made
        # at once would cost several microseconds on most rounds)
        last_step = port.clock()
        urged = False
        late = None                     # a leader this one waited for, if any
        # the others' posts of round k: often already here (read them without a select)
        if not self._hear():
            return passed("stopped", board, posts)
        msgs = self._round_msgs(k)
        while not (len(msgs) == need or any(not m.sig for m in msgs.values())):
            if late is None:
                late = next(r for r in self.leaders if r not in msgs)
            now = port.clock()
            if now - started > board.timeout:   # (settle sends the posts on)
                self._end_round(k)
                late = [r for r in self.leaders if r not in msgs]
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: the leaders of the other hosts (rank(s) {late}) did "
                    f"not post {req.name!r} on their boards within {board.timeout:g} s "
                    f"while their engines lived (HORA_TRANSPORT_TIMEOUT); are they stopped?")
            if not urged and now - started > PATIENCE_S:
                urged = True            # the leaders yet to post this round should veto it
                self._send_round(-k, b"", b"")
            # an engine step to watch the peers' lives, or when another rank than a leader
            # sent something; when only leaders did, just their posts are read: a step of
            # rank 0 costs several microseconds of a CPU the other ranks may need
            ready = select.select(self._ctrl_fds, (), (), 0)[0]
            if now - last_step > STEP_S or not self._leader_fds.issuperset(ready):
                last_step = now
                if port.step():
                    return passed("stopped", board, posts)
                if not urged and self.rank == 0 and port.busy():
                    urged = True        # (rank 0's engine has work: see _urged)
                    self._send_round(-k, b"", b"")
            elif ready:
                if not self._hear():
                    return passed("stopped", board, posts)
            elif not self._wait(started, now):
                return passed("stopped", board, posts)
            msgs = self._round_msgs(k)
        self._end_round(k)
        outcome = round_outcome(msgs, sig, len(mine))
        if outcome is not True:
            return passed(outcome, board, posts)
        out = None
        if req.kind != BARRIER:         # (in host order)
            out = board.combine(req, [mine if r == self.rank else msgs[r].data
                                      for r in board.leaders], size)
        board.answer(posts, RESULT)
        if self.rank == 0:
            self.calls.count_wait(late or 0, started)
        return DONE, out

    # -- outside a call: every engine step ------------------------------------------------------
    def serve(self):
        """A leader outside a board call: veto the next host round when another leader has
        posted it and this one is busy (the host's ranks may wait on the engine) or has not
        posted it within PATIENCE_S (they are elsewhere in the program); a round another
        leader vetoed meanwhile is over here too (the others wait for no post of it), so
        that the next board call plays the round the others play next."""
        while True:
            k = self._round + 1
            msgs = self._round_msgs(k)
            if not msgs:
                return
            vetoed = any(not m.sig for m in msgs.values())
            why = idle_verdict(vetoed, self.port.busy(), self._urged(k),
                               waited(self._round_seen, 0, k, self.port.clock()))
            if why is None:
                return
            # the other hosts go to the engine with the round's collective: this host's
            # ranks should too, when they come to it
            if len(self._retreats) > RETREATS_KEPT:
                self._retreats.clear()
            # (a veto names the vetoing leader's call, when it was in one)
            self._retreats.update(m.sig or m.data for m in msgs.values() if m.sig or m.data)
            if vetoed:                  # a round this host did not play: it is over
                self._end_round(k)
                passed(why)
            else:
                self._veto(self.board.open_posts(), k, why)

    # -- the round's messages -------------------------------------------------------------------
    def _round_msgs(self, k):
        """``{leader: HostPost}``: the other leaders' posts (or vetoes) of host round ``k``
        heard so far."""
        msgs = self.port.side.host_msgs
        return {r: msgs[(r, k)] for r in self.leaders if (r, k) in msgs}

    def _urged(self, k):
        """Whether a leader that posted host round ``k`` asked those that have not to veto
        it: it waited PATIENCE_S for them, or (rank 0) its engine has work under way: a rank
        submitted a collective to the engine (perhaps this one, asynchronously, which this
        host's posts then wait for in vain), joined, or leaves."""
        msgs = self.port.side.host_msgs
        return any((r, -k) in msgs for r in self.leaders)

    def _send_round(self, k, sig, data):
        """This leader's post (``sig``, ``data``) of host round ``k``, or its veto (empty
        ``sig``): rank 0 sends it to every other leader, a leader to rank 0, which relays it."""
        msg = HostPost(self.rank, k, sig, data)
        side = self.port.side
        if self.rank == 0:
            for r in self.leaders:
                side.workers[r].send(msg)
        else:
            side.conn.send(msg)

    def _veto(self, posts, k, why, sig=b"", send=True):
        """Veto host round ``k`` (``why``: the reason counted in the metrics): this host's
        ``posts`` go to the engine, and so do every other host's posts of that round
        (``send``: say so; not when another leader has).  ``sig``: the signature of this
        leader's own call, when it is in one: a leader that hears of the veto before it comes
        to that call sends the call to the engine at once, as the others did, rather than
        play the next round alone."""
        passed(why, self.board, posts)
        if send:
            self._send_round(k, b"", sig)
        self._end_round(k)
        return ENGINE

    def _end_round(self, k):
        """Host round ``k`` is decided here: forget what was heard of it (and before)."""
        self._round = k
        self._round_ended = self.port.clock()
        msgs = self.port.side.host_msgs
        for r in self.leaders:          # the round's own posts (often all there is)
            msgs.pop((r, k), None)
        if msgs:                        # pleas to veto it, older rounds (later ones stay)
            for key in [key for key in msgs if abs(key[1]) <= k]:
                del msgs[key]

    def _hear(self):
        """Read the host posts that came (the side's ``hear_rounds``); False when the
        control connections broke meanwhile (every waiter gets the failure).  Messages of
        other kinds held back meanwhile get a step after the call (:meth:`after_call`)."""
        try:
            if self.port.side.hear_rounds():
                self._held_back = True
            return True
        except Exception as e:      # noqa: BLE001 - as the engine's drive(): every waiter
            self.port.crashed(e)    # gets the failure
            return False

    def _wait(self, started, now):
        """Between two looks of a wait for a control message: poll for the spin budget
        (yielding the CPU where it is crowded), then sleep on the sockets.  False when a
        peer's death was seen meanwhile (every waiter gets the failure)."""
        port = self.port
        if now - started < port.spin_s:
            if port.crowded:
                os.sched_yield()
            return True
        try:
            port.idle(NAP_S, True)
        except Exception as e:      # noqa: BLE001 - a peer died; every waiter gets it
            port.crashed(e)
            return False
        return True
