"""Rank 0's side of the engine: it gathers every rank's requests and answers them.

Each step rank 0 feeds the :class:`~hora.core.negotiation.Coordinator` its own new requests
and every worker's messages, then sends every worker the responses decided, in order, and
runs them itself.  Around that bookkeeping it adds what needs the clock or the sockets:

- the ranks whose messages in one step hold the same cached ids, and nothing else, are one
  entry of each of those collectives (:meth:`~hora.core.negotiation.Coordinator.
  submit_host`), so that a collective costs rank 0 the messages it read, not the ranks;
- small allreduces, whose inputs came with their requests, are answered with their result
  (:mod:`.small`);
- the offer: the last rank gets its answer before it asks (:mod:`.offer`);
- the stall inspector (:mod:`hora.core.stall`): a warning naming the missing ranks, what
  they declared they are doing and where their main threads are, and past
  HORA_STALL_SHUTDOWN_TIME_SECONDS the job's end;
- autotune (:mod:`hora.core.autotune`): it changes the fusion threshold and, through a
  ``Tune`` response, every rank's cycle time.

In a job on several hosts, another host's ranks speak to rank 0 through their host's leader
(:mod:`.leader`): a host's cached requests come in one :class:`~hora.core.wire.HostIds`, the
rest of its ranks' messages each in a :class:`~hora.core.wire.Fwd` naming its rank, and a
stack question goes back the same way.  Rank 0 makes no offers in such a job.

Layer: core.
"""
import logging

from ...errors import HoraInternalError, HoraRankFailedError
from .. import stall, stats, timeline
from ..autotune import Autotuner
from ..links import ctrl_below, ctrl_parents, ctrl_routes
from ..negotiation import Coordinator
from ..wire import (Abort, Accept, Bye, Dead, Fwd, HostIds, HostPost, Nudge, Req, Resp, Stack,
                    StackQuestion, Stats, Trace, Tune)
from .conn import frame
from .offer import OfferDesk
from .small import SMALL_ALLREDUCE, SmallReductions

__all__ = ["CoordinatorSide"]

log = logging.getLogger(__name__)


def _is_activity(doing):
    """``doing`` is what :func:`hora.core.stall.set_activity` declares: (what, advice)."""
    return (isinstance(doing, tuple) and len(doing) == 2
            and all(isinstance(s, str) for s in doing))


def _checked_post(rank, msg):
    if not (msg.src == rank and msg.seq.__class__ is int and msg.sig.__class__ is bytes
            and msg.data.__class__ is bytes):
        raise HoraInternalError(f"rank {rank} sent a malformed host post: {msg!r:.200}")
    return msg


class CoordinatorSide:
    """The coordinator, the control connections to every worker, and what travels on them.

    Args:
        size: the job's size.
        workers: ``{rank: Conn}`` for every other rank.
        executor: this rank's :class:`~hora.core.engine.executor.Executor`.
        settings: :class:`hora.config.Settings`.
        clock: the engine's monotonic clock.
        on_tune: ``on_tune(cycle_ms)``: autotune chose a new cycle time.
        hosts: every rank's host name (None: one host): the ranks of another host than
            rank 0's speak through its leader, the only one of them in ``workers``.
    """

    def __init__(self, size, workers, executor, settings, clock, on_tune, hosts=None):
        self.coord = Coordinator(size, settings.fusion_threshold, settings.cache_capacity)
        self.workers = workers
        self.conns = list(workers.values())
        self._size = size
        self._exec = executor
        self._settings = settings
        self._clock = clock
        self._on_tune = on_tune
        self._small = SmallReductions(self.coord)
        self._offers = OfferDesk(self.coord, range(1, size), SMALL_ALLREDUCE)
        self._stacks = stall.StackRequests()
        self._doing = {}            # rank -> (its declared activity or None, when it said so)
        self._hinted = set()        # ranks whose activity the last stall warning gave
        self._waits = {}            # rank -> (what its main thread waits for, when it said so)
        self.stop_reason = None     # set from another thread: end the job (Engine.stop_job)
        self.parent = None          # (rank 0's control connections all come to it)
        self._last_stall_log = clock()
        self._tuner = self._make_tuner(settings) if settings.autotune else None
        self.host_msgs = {}         # (leader, host round) -> its HostPost (see the board)
        self.relay = ()             # the leaders of the other hosts, to relay each one's to
        executor.tuning = self._tuner is not None
        # a rank behind a host leader -> the leader connected here that leads to it; such a
        # leader -> every rank it gathers (itself among them)
        below = ctrl_below(ctrl_routes(0, ctrl_parents(hosts or (), settings.control_fanout)))
        self._below = {leader: frozenset(ranks) for leader, ranks in below.items()}
        self._via = {r: leader for leader, ranks in below.items() for r in ranks if r != leader}

    def idle(self):
        """Whether the coordinator has nothing under way (see Coordinator.idle)."""
        return self.coord.idle()

    def step(self, new, leaving):
        """Submit rank 0's ``new`` requests (and its goodbye, when ``leaving``), read every
        worker's messages, send and run the responses.  Returns True when the job is over."""
        if self.stop_reason is not None:
            self._stop_job(self.stop_reason)
        now = self._clock()
        coord, ex = self.coord, self._exec
        rec = timeline._recorder
        coord.arrivals = None if rec is None else (coord.arrivals or {})
        if new:
            coord.submit(0, new, now)
        if leaving:
            coord.depart(0)
        heard, responses, ran = self._hear_workers(now, rec)
        if self._waits:
            self._end_deadlock()
        responses += [self._small.settle(r, ex.pending) for r in coord.take_responses()]
        if responses:
            self._send_responses(responses, ran)
        if new or leaving or heard:
            self._make_offer()
        self._check_stalls(now)
        if rec is not None:
            self._trace_negotiations(rec)
        finished = ex.run_all(responses)
        if self._tuner is not None and ex.tuned_bytes:
            self._tune(ex.tuned_bytes)
        ex.tuned_bytes = 0
        return finished

    def _hear_workers(self, now, rec):
        """Read every worker's messages and act on them.  Returns ``(changed, responses,
        ran)``: whether a request, acceptance or goodbye came (a new offer may be due), the
        responses an acceptance settled, and where the accepting worker already ran its
        own (see :meth:`_accept`), or None."""
        changed, responses, ran = False, [], None
        # the ranks that sent nothing but cached ids, by ids (None: the timeline wants each
        # rank's arrival): one entry a collective for all of them, submitted before any
        # other message is taken, and before a second such message of one rank
        alike, grouped = ({}, set()) if rec is None else (None, None)
        for sender, conn in self.workers.items():
            for msg in conn.receive():
                cls, rank = msg.__class__, sender
                if cls is Req and alike is not None and not msg.full:
                    changed = True
                    self._offers.heard(rank, msg)
                    self._small.take(rank, (), msg.small, msg.ids)
                    stats.counters.cache_hits += len(msg.ids)
                    if rank in grouped:
                        self._submit_alike(alike, grouped, now)
                    grouped.add(rank)
                    alike.setdefault(tuple(msg.ids), []).append(rank)
                    continue
                if alike:
                    self._submit_alike(alike, grouped, now)
                if cls is Fwd or cls is HostIds:    # from a host's leader
                    if cls is HostIds:
                        self._take_host(sender, msg, now)
                        changed = True
                        continue
                    rank, msg = msg.src, msg.body
                    cls = msg.__class__
                    if rank != sender and self._via.get(rank) != sender:
                        raise HoraInternalError(f"rank {sender} passed on a message of rank "
                                                f"{rank}, which is not below it")
                if cls is Req or cls is Accept or cls is Bye:
                    changed = True
                    offer = self._offers.heard(rank, msg)
                if cls is Req:
                    # the timeline says who came last: each message's own arrival time
                    self._take_request(rank, msg.full, msg.small, msg.ids,
                                       now if rec is None else self._clock())
                elif cls is Accept:
                    ran = self._accept(rank, msg, offer, now, responses)
                elif cls is Bye:
                    self.coord.depart(rank)
                else:
                    self._hear_other(rank, msg)
        if alike:
            self._submit_alike(alike, grouped, now)
        return changed, responses, ran

    def _submit_alike(self, alike, grouped, now):
        """Submit what :meth:`_hear_workers` gathered in ``alike`` (``{ids: [ranks]}``;
        ``grouped``: those ranks), and empty both: ranks that sent the same ids as one
        entry (``Coordinator.submit_host``), so that what a collective costs rank 0 grows
        with the messages it reads in a step, not with the ranks behind them."""
        coord = self.coord
        for ids, ranks in alike.items():
            if len(ranks) == 1:
                coord.submit(ranks[0], (), now, ids)
            else:
                coord.submit_host(tuple(ranks), ids, now)
        alike.clear()
        grouped.clear()

    def _accept(self, rank, msg, offer, now, responses):
        """``rank`` accepted ``offer``: submit its share, check that the responses that
        settles are the ones offered, and add them to ``responses``.  Returns ``(rank,
        start, end)``: the worker has run ``responses[start:end]`` already, and must not get
        them again."""
        if offer is None or offer.rank != rank or offer.number != msg.number:
            raise HoraInternalError(f"rank {rank} accepted offer {msg.number}, which is not "
                                    f"the one out ({offer and offer.number})")
        coord = self.coord
        coord.submit(rank, (), now, offer.ids)
        got = [self._small.settle(r, self._exec.pending) for r in coord.take_responses()]
        start = len(got) - len(offer.responses)
        if got[start:] != list(offer.responses):
            raise HoraInternalError(f"offer {offer.number} to rank {rank} was "
                                    f"{offer.responses}, and its acceptance gave {got}")
        start += len(responses)
        responses += got
        ran = (rank, start, len(responses))
        self._take_request(rank, msg.full, msg.small, msg.ids, now)
        return ran

    def _take_host(self, leader, msg, now):
        """A host leader's :class:`~hora.core.wire.HostIds`: the ranks ``msg.ranks`` (below
        it) submitted the cached ``ids``."""
        ranks = msg.ranks
        if not self._below.get(leader, frozenset()).issuperset(ranks):
            raise HoraInternalError(f"rank {leader} passed on the requests of ranks "
                                    f"{list(ranks)[:8]}, which are not below it")
        self._small.take_host(ranks, msg.small, msg.ids)
        stats.counters.cache_hits += len(msg.ids) * len(ranks)
        self.coord.submit_host(ranks, msg.ids, now)

    def _hear_other(self, rank, msg):
        """A worker's message that is not about requests: a host's board, a dead rank, the
        rank's stats, timeline or stack."""
        cls = msg.__class__
        if cls is Nudge:                # a board's post waits: its host's leader
            for r in self.relay:        # should look (rank 0 does, by waking up)
                if r != rank:
                    self.workers[r].send(msg)
        elif cls is HostPost:
            self._host_post(rank, msg)
        elif cls is Dead:
            raise HoraRankFailedError(msg.text, rank=msg.rank)
        elif cls is Stats:
            writer = stats.writer()
            if writer is not None:
                writer.take(rank, msg.values)
        elif cls is Trace:
            writer = timeline.writer()
            if writer is not None:
                writer.write(rank, msg.events)
        elif cls is Stack:
            self._hear_stack(rank, msg)

    def _hear_stack(self, rank, msg):
        """A worker's answer to the stall inspector: its stack, what it declared it is doing
        and what its main thread waits for, kept for the next warning or deadlock check."""
        heard = self._clock()
        doing = msg.doing if _is_activity(msg.doing) else None
        self._doing[rank] = (doing, heard)
        late = self._stacks.answer(rank, msg.token, msg.text, heard, doing)
        if late:
            log.warning("%s", late)
        if isinstance(msg.waits, str):
            self._waits[rank] = (msg.waits, heard)

    def _send_responses(self, responses, ran):
        """Send every worker the step's responses, in order; the worker that accepted an
        offer gets them without the ones it ran already (``ran``)."""
        everyone = frame(Resp(responses))
        for rank, conn in self.workers.items():
            if ran is not None and ran[0] == rank:
                mine = responses[:ran[1]] + responses[ran[2]:]
                if mine:
                    conn.send(Resp(mine))
            else:
                conn.send_frame(everyone)

    def hear_rounds(self):
        """A leader waiting in a host round (rank 0): take the other leaders' host posts
        that have arrived, and relay them; whatever else they sent waits in the connection
        for the next step (an engine step costs rank 0 several times as much).  Returns
        whether something waits so."""
        held = False
        for rank in self.relay:
            posts, kept = self.workers[rank].receive_only(HostPost)
            held |= kept
            for msg in posts:
                self._host_post(rank, msg)
        return held

    def _host_post(self, rank, msg):
        self.host_msgs[(rank, msg.seq)] = _checked_post(rank, msg)
        for r in self.relay:                # the other leaders hear it too
            if r != rank:
                self.workers[r].send(msg)

    def _trace_negotiations(self, rec):
        """The timeline: when each rank's request of every collective completed meanwhile
        arrived, and who came last; then rank 0's own events go to the writer."""
        for (_, name), arrived in self.coord.negotiated:
            first = min(arrived.values())
            last = max(arrived, key=arrived.get)
            rec.span(name, "NEGOTIATION", first, arrived[last],
                     {"arrived_ms": {str(r): round((t - first) * 1e3, 3)
                                     for r, t in sorted(arrived.items())}, "last": last})
        self.coord.negotiated.clear()
        writer = timeline.writer()
        if writer is not None and rec.due():
            writer.write(0, rec.take())

    def _take_request(self, rank, full, small, ids, now):
        """``rank`` submitted ``full`` requests and the cached ``ids`` (``small``: the
        inputs of its small allreduces)."""
        self._small.take(rank, full, small, ids)
        stats.counters.cache_hits += len(ids)
        stats.counters.cache_misses += len(full)
        self.coord.submit(rank, full, now, ids)

    def _make_offer(self):
        if self._tuner is not None or self._size < 2 or self._below:
            return      # autotune changes the fusion an offer was made with; a leader would
            #             have to hold its ranks' requests back until the offer
        made = self._offers.make()
        if made is not None:
            rank, offer = made
            self.workers[rank].send(offer)

    # -- autotune (hora.core.autotune) ------------------------------------------------------
    def _make_tuner(self, settings):
        try:
            log_file = open(settings.autotune_log, "w") if settings.autotune_log else None
            tuner = Autotuner(settings.fusion_threshold, settings.cycle_time_ms, log_file,
                              settings.autotune_warmup_samples,
                              settings.autotune_steps_per_sample)
        except OSError as e:        # the log file (HORA_AUTOTUNE_LOG) cannot be written
            log.warning("autotune disabled: %s", e)
            return None
        except Exception:  # noqa: BLE001 - a bug in the tuner must not fail the job
            log.error("autotune disabled: the tuner failed to start", exc_info=True)
            return None
        self._tune_log = log_file
        return tuner

    def _stop_tuning(self):
        self._tuner = None
        self._exec.tuning = False

    def _tune(self, nbytes):
        try:
            change = self._tuner.record(nbytes, self._clock())
        except OSError as e:        # its log file
            log.warning("autotune stopped: %s", e)
            self._stop_tuning()
            return
        except Exception:  # noqa: BLE001 - a bug in the tuner must not fail the job
            log.error("autotune stopped: the tuner failed", exc_info=True)
            self._stop_tuning()
            return
        if change is None:
            return
        fusion, cycle_ms = change
        self.coord.fusion_threshold = fusion
        self._on_tune(cycle_ms)
        for conn in self.conns:
            conn.send(Resp([Tune(cycle_ms)]))
        if self._tuner.done:
            log.info("autotune chose HORA_FUSION_THRESHOLD=%d HORA_CYCLE_TIME=%g", fusion,
                     cycle_ms)
            if self._tune_log is not None:
                self._tune_log.close()
            self._stop_tuning()

    # -- stall inspector (hora.core.stall) ----------------------------------------------------
    def _check_stalls(self, now):
        """Warn about collectives some ranks have not submitted; past
        HORA_STALL_SHUTDOWN_TIME_SECONDS, fail the whole job naming them."""
        s = self._settings
        if not s.stall_check:
            return
        self._report_stacks(now)
        if s.stall_shutdown_s > 0:
            stuck = self.coord.stalled(now, s.stall_shutdown_s)
            if stuck:
                message = (f"collectives stalled for more than {s.stall_shutdown_s:g} s "
                           f"(HORA_STALL_SHUTDOWN_TIME_SECONDS); missing ranks:\n"
                           f"{stall.missing_lines(stuck)}")
                self._stop_job(message)
        if now - self._last_stall_log < s.stall_warning_s:
            return
        missing = self.coord.stalled(now, s.stall_warning_s)
        if missing:
            self._last_stall_log = now
            self._warn_stall(now, missing)

    def _stop_job(self, message):
        """End the job: every worker fails with ``message``, as this rank does."""
        log.error("%s", message)
        for conn in self.conns:
            conn.send_nowait(Abort(message))
        raise HoraInternalError(message)

    def _end_deadlock(self):
        """A stall in which every rank waits for a collective that another rank did not
        submit can only end by error: fail those collectives on every rank
        (:meth:`Coordinator.deadlock`), from what the workers' stack answers said they wait
        for (an answer counts until its rank submits again) and what rank 0 waits for now."""
        last = self.coord.last_submit
        self._waits = {r: (name, heard) for r, (name, heard) in self._waits.items()
                       if heard >= last.get(r, heard)}
        if not self._waits:
            return
        waits = {r: name for r, (name, _) in self._waits.items()}
        waits[0] = stall.main_thread_waits()
        message = self.coord.deadlock(waits)
        if message is not None:
            self._waits.clear()
            log.error("%s", message)

    def _warn_stall(self, now, missing):
        """Log Horovod's stall warning with hints, and ask the missing ranks where their
        main threads are; the answers are logged as they come, never waited for."""
        stats.counters.stall_warnings += 1
        after = self._settings.stall_warning_s
        doing = self._activities()
        self._hinted = set(doing)
        hints = stall.hints(self.coord.stalled_collectives(now, after),
                            self.coord.last_submit, now, after, doing)
        log.warning("%s", stall.warning_text(missing, hints, after))
        token, ask = self._stacks.ask(missing, now)
        for rank in ask:
            if rank == 0:
                self._stacks.answer(0, token, stall.main_thread_stack(), now, doing.get(0))
            elif rank in self.workers:
                self.workers[rank].send(StackQuestion(token))
            elif rank in self._via:
                self.workers[self._via[rank]].send(Fwd(rank, StackQuestion(token)))
        self._report_stacks(now)

    def _activities(self):
        """``{rank: (what, advice)}``: what the ranks declared they are doing
        (:func:`hora.core.stall.set_activity`): rank 0's now, a worker's as of its latest
        stack answer, unless it has submitted a collective since (then it has moved on)."""
        doing = {}
        for rank, (said, heard) in self._doing.items():
            if said is not None and heard >= self.coord.last_submit.get(rank, heard):
                doing[rank] = said
        own = stall.current_activity()
        if own is not None:
            doing[0] = own
        return doing

    def _report_stacks(self, now):
        text = self._stacks.report(now)
        if not text:
            return
        # the activities the answers brought, which the warning could not give yet
        doing = {r: d for r, d in self._activities().items() if r not in self._hinted}
        if doing:
            after = self._settings.stall_warning_s
            lines = stall.activity_hints(self.coord.stalled_collectives(now, after), doing)
            text = "\n".join([text] + lines)
            self._hinted.update(doing)
        log.warning("%s", text)
