"""The driver of an elastic job on Ray (:class:`ElasticRun`, one
:meth:`~hora.integrations.ray_elastic.ElasticRayExecutor.run`): it serves the job's
rendezvous store, starts one actor per slot that discovery reports, forms the job in rounds
as the actors start, fail and leave, and collects the final round's values.

Layer: integrations.  ``ray`` is imported lazily; imports the runner's elastic helpers, the
rendezvous server and its rounds' records, :mod:`hora.integrations.ray`'s worker and
:mod:`hora.integrations.ray_discovery`'s placement.
"""
import dataclasses
import functools
import logging
import math
import os
import pickle
import time
import uuid

from ..config import remove_segments_of
from ..rendezvous.rounds import READY_PREFIX, ROUND_PREFIX
from ..errors import (CollectiveTimeoutError, ElasticJobError, ElasticTimeoutError, HoraError,
                      WorkerFailedError)
from ..rendezvous import RendezvousServer, new_secret
from ..runner.contract import job_env
from ..runner.discovery import DISCOVERY_PERIOD_S
from ..runner.elastic import (Blacklist, Rounds, elastic_job_env, elastic_worker_env,
                              free_slots)
from .ray import REPORT_PREFIX, BaseHoraWorker
from .ray_discovery import actor_options

__all__ = ["ElasticRun"]

log = logging.getLogger(__name__)

_TICK_S = 0.2           # the driver's loop: actors' ends wake it at once


class _ElasticWorker(BaseHoraWorker):
    """The Ray actor of one elastic worker."""

    def set_env(self, env):
        """Make ``env`` this actor's job environment (and drop any fixed placement)."""
        for name in ("HORA_RANK", "HORA_SIZE", "HOROVOD_RANK", "HOROVOD_SIZE"):
            os.environ.pop(name, None)
        os.environ.update({str(k): str(v) for k, v in env.items()})


def _elastic_call(fn, _executable):
    """In an actor: ``fn()``, and the round this actor was last in when it returned."""
    from ..core import membership
    value = fn()
    return membership.current_round(), value


@dataclasses.dataclass
class _Member:
    """What the driver knows of one worker (one actor) of an elastic run."""
    wid: int
    host: str
    actor: object
    ref: object                 # the function's ObjectRef
    info: object                # placement()'s ObjectRef, until it answers
    started: float              # monotonic time the actor was asked for
    pid: int = None
    node_id: str = None
    rank: int = None            # in the latest round that named it
    placed: bool = False        # named in a round
    leaving: bool = False       # killed by the driver (its host left, or the run ended)
    state: str = "running"      # running, done, failed, stopped
    value: object = None        # (round, result) once done
    error: BaseException = None

    def describe(self):
        rank = f"rank {self.rank}, " if self.rank is not None else ""
        pid = f", pid {self.pid}" if self.pid is not None else ""
        return (f"worker {self.wid} ({rank}Ray actor {self.actor._actor_id.hex()[:12]}{pid}, "
                f"host {self.host})")


class ElasticRun:
    """One :meth:`ElasticRayExecutor.run`: the driver's loop, in the caller's thread.

    Reads the executor's settings and worker resources, polls its ``discovery``, and lists
    the workers it starts in ``executor.workers``.
    """

    def __init__(self, executor, discovery, worker_fn, callbacks, timeout_s):
        self.ex = executor
        self.discovery = discovery
        self.settings = executor.settings
        self.fn = functools.partial(_elastic_call, worker_fn)
        self.callbacks = callbacks
        self.timeout_s = timeout_s
        self.members = {}           # wid -> _Member
        self.blacklist = Blacklist(self.settings.cooldown_range)
        self.hosts = []             # HostSpecs: discovery's last answer
        self.final = None           # the wids of the round the first returned worker was in
        self.failures = []          # failed _Members, in the order seen
        self.server = None
        self.rounds = None
        self.delivered = set()      # report keys handed to the callbacks
        self._next_wid = 0
        self._first_spawn = None
        self._final_since = None
        self._driver_node = None

    # -- the loop ----------------------------------------------------------------------------
    def run(self):
        import ray
        s = self.settings
        self._driver_node = ray.get_runtime_context().get_node_id()
        addr = next((n["NodeManagerAddress"] for n in ray.nodes()
                     if n["NodeID"] == self._driver_node), "127.0.0.1")
        bind = "127.0.0.1" if addr.startswith("127.") else "0.0.0.0"
        secret = new_secret()
        self.server = RendezvousServer(secret, host=bind, port=0).start()
        self.rounds = Rounds(self.server, s.min_num_proc, s.max_num_proc, s.reset_limit,
                             s.elastic_timeout, min_name="min_num_proc")
        base = job_env({}, self.ex.env_vars, sorted(s.nics)[0] if s.nics else None,
                       s.timeout_s)
        self.env = (elastic_job_env(base, s.elastic_timeout + s.timeout_s), addr,
                    self.server.port, secret, uuid.uuid4().hex[:12])
        self.hosts = self.discovery.poll()
        started = time.monotonic()
        next_discovery = started + DISCOVERY_PERIOD_S
        self._top_up()
        while True:
            self._wait(_TICK_S)
            self._deliver()
            now = time.monotonic()
            if self.final is not None:
                done = self._finished()
                if done is not None:
                    return done
            if self.timeout_s is not None and now - started > self.timeout_s:
                running = [m.describe() for m in self._live()]
                raise CollectiveTimeoutError(
                    f"ElasticRayExecutor.run: not done within {self.timeout_s:g} s; "
                    f"{', '.join(running) or 'no worker'} still running (killed)")
            if self.final is not None:
                continue
            self._check_starts(now)
            if now >= next_discovery:
                next_discovery = now + DISCOVERY_PERIOD_S
                self._rediscover()
            self._top_up()
            self._admit_ready(now)
            self._check_limits(now)

    def _wait(self, timeout):
        """Wait up to ``timeout`` for an actor to answer; take in every answer there is."""
        import ray
        refs = {}
        for m in self.members.values():
            if m.state == "running":
                refs[m.ref] = (m, "fn")
                if m.info is not None:
                    refs[m.info] = (m, "info")
        if not refs:
            time.sleep(timeout)
            return
        ready, _ = ray.wait(list(refs), num_returns=1, timeout=timeout)
        if ready:
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in sorted(ready, key=lambda r: refs[r][1] != "info"):   # placements first
            m, what = refs[ref]
            if what == "info":
                m.info = None
                try:
                    m.node_id, _, m.pid, _ = ray.get(ref, timeout=0)
                except ray.exceptions.RayError:
                    continue            # the function's ref says how the actor ended
                log.debug("elastic: worker %d started in %.1f s (pid %d)", m.wid,
                          time.monotonic() - m.started, m.pid)
                continue
            try:
                value = ray.get(ref, timeout=0)
            except ray.exceptions.RayError as e:      # raised, died, never started
                self._on_failed(m, e)
            else:
                self._on_done(m, value)

    # -- events ------------------------------------------------------------------------------
    def _on_done(self, m, value):
        m.state, m.value = "done", value
        if self.final is not None:
            return
        round_number, _ = value
        if round_number is None:
            raise HoraError(f"ElasticRayExecutor.run: {m.describe()} returned without joining "
                            f"the job: the function must call hora.init() (and train in "
                            f"hvd.elastic.run)")
        record = self.server.get(f"{ROUND_PREFIX}{round_number}")
        self.final = [int(w) for w, _ in record["members"]]
        self._final_since = time.monotonic()
        log.info("elastic: worker %d returned in round %d; the job is finishing", m.wid,
                 round_number)
        for other in self._live():
            if other.wid not in self.final:
                self._kill(other, "the job is finishing without it")

    def _on_failed(self, m, error):
        import ray
        if m.leaving:
            m.state = "stopped"
            return
        m.state, m.error = "failed", error
        self.failures.append(m)
        if isinstance(error, ray.exceptions.RayTaskError):
            ray.kill(m.actor, no_restart=True)      # its peers must see it go
        out = self.blacklist.add(m.host)
        how = "died" if isinstance(error, ray.exceptions.RayActorError) else "raised"
        log.warning("elastic: %s %s (%s); %s", m.describe(), how, _first_line(error),
                    f"no new worker starts on {m.host} for {out:.1f} s"
                    if out != math.inf else f"no new worker starts on {m.host} in this run")
        if self.final is None and m.placed and m.wid in self.rounds.order:
            self._reform("removed")

    def _check_starts(self, now):
        """Kill the actors that did not start within ``timeout_s`` (counted as failures)."""
        import ray
        for m in self._live():
            if m.info is not None and now - m.started > self.settings.timeout_s:
                log.warning("elastic: %s did not start within %g s (timeout_s)", m.describe(),
                            self.settings.timeout_s)
                ray.kill(m.actor, no_restart=True)
                m.info = None
                self._on_failed(m, HoraError(f"{m.describe()} did not start within "
                                             f"{self.settings.timeout_s:g} s (timeout_s)"))

    def _rediscover(self):
        self.hosts = self.discovery.poll()
        names = {h.hostname for h in self.hosts}
        gone = [m for m in self._live() if m.host not in names]
        for m in gone:
            self._kill(m, f"host {m.host} left the discovery's answer")
        if any(m.placed for m in gone):
            self._reform("removed")

    def _top_up(self):
        """Start actors on free, usable slots, up to ``max_num_proc``."""
        limit = self.settings.max_num_proc or math.inf
        live = self._live()
        if len(live) >= limit:
            return
        used = {}
        for m in live:
            used[m.host] = used.get(m.host, 0) + 1
        for host in free_slots(self.hosts, used, self.blacklist,
                               int(min(limit - len(live), 1 << 16))):
            self._spawn(host)

    def _admit_ready(self, now):
        """Put the started workers that reached ``hora.init()`` into a new round.  Before the
        first round, wait (up to ``timeout_s``) for all the actors started."""
        waiting = [m for m in self._live() if not m.placed]
        ready = [m for m in waiting
                 if self.server.get(f"{READY_PREFIX}{m.wid}") is not None]
        if not ready:
            return
        if self.rounds.number < 0 and len(ready) < len(waiting) and \
                now - self._first_spawn < self.settings.timeout_s:
            return
        for m in ready:
            m.placed = True
        self._reform("added", added=[m.wid for m in ready])

    def _reform(self, change, added=()):
        placed = [m.wid for m in self._live() if m.placed]
        if self.rounds.reform(placed, {w: m.host for w, m in self.members.items()}, change,
                              added):
            for rank, wid in enumerate(self.rounds.order):
                self.members[wid].rank = rank

    def _check_limits(self, now):
        s = self.settings
        live = self._live()
        if not live and self.failures and self._raised_last():
            raise self._failure_error(self._first_raised(), "every worker has failed; ")
        if self.rounds.number < 0 and (self._first_spawn is None
                                       or now - self._first_spawn > s.timeout_s):
            # no first round yet: no usable slot, or too few workers reached init()
            self.rounds.note_short(len([m for m in live if m.placed]))
        if self.rounds.short_for(now) > s.elastic_timeout:
            last = f"; the last to fail: {self.failures[-1].describe()}" if self.failures else ""
            raise ElasticTimeoutError(
                f"ElasticRayExecutor.run: the elastic job has {len(live)} worker(s), fewer "
                f"than min_num_proc {s.min_num_proc}, and not enough came within "
                f"{s.elastic_timeout:g} s (elastic_timeout){last}",
                workers=len(live), min_workers=s.min_num_proc)
        if self.rounds.over_limit:
            raise ElasticJobError(
                f"ElasticRayExecutor.run: the elastic job was stopped: it re-formed "
                f"{self.rounds.number + 1} times, more than reset_limit {s.reset_limit}")

    def _finished(self):
        """The final round's values in rank order once all are in; raise for a final worker
        that failed; None while some still run."""
        final = [self.members[w] for w in self.final]
        failed = [m for m in final if m.state in ("failed", "stopped")]
        if failed:
            raise self._failure_error(failed[0], "a worker of the final round failed after "
                                                 "another had returned; ")
        if all(m.state == "done" for m in final):
            return [m.value[1] for m in final]
        late = [m.describe() for m in final if m.state == "running"]
        if time.monotonic() - self._final_since > self.settings.elastic_timeout:
            raise CollectiveTimeoutError(
                f"ElasticRayExecutor.run: {', '.join(late)} did not return within "
                f"{self.settings.elastic_timeout:g} s (elastic_timeout) of another worker of "
                f"its round (killed)")
        return None

    # -- workers -----------------------------------------------------------------------------
    def _spawn(self, host):
        import ray
        wid = self._next_wid
        self._next_wid += 1
        base, addr, port, secret, job_id = self.env
        options = dict(num_cpus=self.ex.cpus_per_slot, num_gpus=self.ex.gpus_per_slot,
                       max_restarts=0, **actor_options(host))
        actor = ray.remote(_ElasticWorker).options(**options).remote()
        actor.set_env.remote(elastic_worker_env(base, wid, host, addr, port, secret, job_id))
        info = actor.placement.remote()
        ref = actor.execute.remote(self.fn)
        now = time.monotonic()
        self._first_spawn = self._first_spawn or now
        self.members[wid] = member = _Member(wid, host, actor, ref, info, now)
        self.ex.workers.append(member)
        log.debug("elastic: started worker %d on %s", wid, host)

    def _kill(self, m, why):
        import ray
        log.info("elastic: stopping %s: %s", m.describe(), why)
        m.leaving = True
        ray.kill(m.actor, no_restart=True)

    def _live(self):
        return [m for m in self.members.values() if m.state == "running" and not m.leaving]

    def _raised_last(self):
        """Whether the last failure was a raised error (which a new worker would most
        likely raise again), not a lost actor."""
        import ray
        return isinstance(self.failures[-1].error, ray.exceptions.RayTaskError)

    def _first_raised(self):
        import ray
        return next(m for m in self.failures
                    if isinstance(m.error, ray.exceptions.RayTaskError))

    def _failure_error(self, m, context):
        import ray
        error = m.error
        if isinstance(error, ray.exceptions.RayTaskError):
            detail = str(error)
            message = f"ElasticRayExecutor.run: {context}{m.describe()} raised:\n{detail}"
        elif isinstance(error, ray.exceptions.RayActorError):
            detail = f"its Ray actor died: {_first_line(error)}"
            message = f"ElasticRayExecutor.run: {context}{m.describe()}: {detail}"
        else:
            detail = _first_line(error) if error is not None else "it was stopped"
            message = f"ElasticRayExecutor.run: {context}{m.describe()}: {detail}"
        err = WorkerFailedError(message, rank=m.rank, host=m.host, detail=detail)
        err.__cause__ = error
        return err

    # -- callbacks and the end ---------------------------------------------------------------
    def _deliver(self):
        """Hand the values rank 0 reported since the last call to the callbacks."""
        if not self.callbacks or self.server is None:
            return
        new = sorted((k, v) for k, v in self.server.items(REPORT_PREFIX).items()
                     if k not in self.delivered)
        for key, blob in new:
            self.delivered.add(key)
            value = pickle.loads(blob)      # from an authenticated worker of this job
            for callback in self.callbacks:
                callback(value)

    def records(self):
        """The rounds written in this run, in order."""
        if self.server is None:
            return []
        items = self.server.items(ROUND_PREFIX)
        return [items[k] for k in sorted(items, key=lambda k: int(k[len(ROUND_PREFIX):]))]

    def close(self):
        """Let the workers that returned leave the job, kill every actor, stop the store."""
        import ray
        try:
            self._deliver()
        finally:
            done = [m for m in self.members.values() if m.state == "done"]
            if done:
                refs = [m.actor.shutdown_hora.remote() for m in done]
                ray.wait(refs, num_returns=len(refs), timeout=self.settings.shutdown_timeout_s)
            for m in self.members.values():
                if m.state == "running":
                    m.leaving, m.state = True, "stopped"
                ray.kill(m.actor, no_restart=True)
            if self.server is not None:
                self.server.stop()
            pids = [m.pid for m in self.members.values()
                    if m.pid is not None and m.node_id == self._driver_node]
            for path in remove_segments_of(pids):
                log.debug("removed %s, left behind by a worker", path)


def _first_line(error):
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
