"""Elastic jobs: ``hora run --min-np A --max-np B [--host-discovery-script S | -H ...]``.

The launcher of an elastic job outlives its workers.  It starts workers on the hosts it
knows, and forms the job in *rounds* (:mod:`hora.rendezvous.rounds`): round ``n`` lists its
members in rank order, in the rendezvous store that every worker reads.  Then it watches:

- a worker exits non-zero or is killed: it leaves the job, its host is blacklisted (no new
  worker starts there until the cooldown of ``--blacklist-cooldown-range`` ends; without
  it, never again), and a new round with the survivors is written at once.  The survivors'
  collectives fail (``HorovodInternalError``), ``hvd.elastic.run`` restores their last
  commit, and they join the new round in-process: nothing restarts;
- the discovery script (run about once a second, :mod:`hora.runner.discovery`;
  ``host[:slots]`` lines) lists more slots than are running: new workers start there, and
  once each has reached ``init()`` a round that includes them is written; the running
  workers join it at their next ``state.commit()`` (``HostsUpdatedInterrupt``) and rank 0
  hands them the state;
- a host leaves the discovery output: its workers are stopped and a round without them is
  written;
- fewer than ``--min-np`` workers: no round is written until enough are back; after
  ``--elastic-timeout`` seconds the job fails, saying so.  This holds with no worker left
  too, when discovery may bring hosts back: their workers were stopped because their hosts
  left the output, or lost to a signal; not when the last one failed of itself;
- more resets (rounds after the first) than ``--reset-limit``: the job fails, saying so;
- a worker exits 0: the job is finishing; no round is written any more and workers not
  yet placed are stopped; the job succeeds when every placed worker exits 0.

The launcher itself must not die: it holds the rendezvous and the job's record.  Its
workers get a parent-death signal, so a killed launcher leaves nothing running.

Layer: runner.  Imports hora.errors, hora.config and hora.rendezvous (the rounds' records:
:mod:`hora.rendezvous.rounds`), never hora.core.
"""
import dataclasses
import logging
import os
import random
import signal
import sys
import time
import uuid

from ..rendezvous.rounds import LATEST_KEY, READY_PREFIX, ROUND_PREFIX, round_record
from ..rendezvous import RendezvousServer, new_secret
from . import proc
from .contract import job_env, worker_env
from .discovery import DISCOVERY_PERIOD_S, Discovery, parse_discovery_output
from .hosts import HostSpec, SlotInfo, is_local_host, parse_hosts, parse_hostfile
from .launcher import Job, JobResult, reserve_open_files, serving
from .launch_config import one_interface
from .output import OutputPump
from .remote import SshSettings
from .supervisor import Supervisor, WorkerState

__all__ = ["ElasticSettings", "ElasticJob", "Blacklist", "Discovery", "Rounds",
           "parse_discovery_output", "free_slots", "elastic_job_env", "elastic_worker_env",
           "RESET_LIMIT_MESSAGE"]

log = logging.getLogger(__name__)

_TICK_S = 0.25                  # the launcher's loop (joiners, discovery); exits wake it at once
EXIT_FAILED = 1
RESET_LIMIT_MESSAGE = ("hora: the elastic job was stopped: it re-formed {resets} times, more "
                       "than --reset-limit {limit}")


@dataclasses.dataclass(frozen=True)
class ElasticSettings:
    """What makes a launch elastic.

    Attributes:
        min_np: the job runs with no fewer workers (waits for more up to ``timeout_s``).
        max_np: it never runs more (None: as many as the hosts have slots).
        discovery_script: prints the available hosts, ``host[:slots]`` a line; None: the
            fixed hosts of ``-H``/``--hostfile``, which may only shrink.
        slots: slots of a discovered host whose line gives none.
        reset_limit: fail the job after this many resets (None: no limit).
        cooldown: ``(min_s, max_s)``: a blacklisted host is retried after
            ``min_s * 2**(failures-1)`` plus up to ``min_s`` at random, at most ``max_s``;
            None: a host that failed is never used again.
        timeout_s: seconds to wait for ``min_np`` workers before failing.
    """
    min_np: int
    max_np: "int | None" = None
    discovery_script: "str | None" = None
    slots: int = 1
    reset_limit: "int | None" = None
    cooldown: "tuple[float, float] | None" = None
    timeout_s: float = 600.0

    def __post_init__(self):
        if self.min_np < 1:
            raise ValueError(f"--min-np must be at least 1, got {self.min_np}")
        if self.max_np is not None and self.max_np < self.min_np:
            raise ValueError(f"--max-np {self.max_np} is less than --min-np {self.min_np}")
        if self.slots < 1:
            raise ValueError(f"--slots must be at least 1, got {self.slots}")
        if self.reset_limit is not None and self.reset_limit < 0:
            raise ValueError(f"--reset-limit must be >= 0, got {self.reset_limit}")
        if self.cooldown is not None:
            low, high = self.cooldown
            if not 1 <= low <= high <= 3600:
                raise ValueError(f"--blacklist-cooldown-range {low:g} {high:g}: expected "
                                 f"1 <= MIN <= MAX <= 3600 seconds")
        if not self.timeout_s > 0:
            raise ValueError(f"--elastic-timeout must be positive, got {self.timeout_s}")


class Blacklist:
    """Hosts whose workers failed, and when each may be used again."""

    def __init__(self, cooldown=None, clock=time.monotonic, rng=None):
        self._cooldown = cooldown
        self._clock = clock
        self._rng = rng or random.Random()
        self._failures = {}         # host -> failures so far
        self._until = {}            # host -> monotonic time it is usable again (inf: never)

    def add(self, host):
        """A worker of ``host`` failed: return the seconds it is out for (inf: for good)."""
        count = self._failures[host] = self._failures.get(host, 0) + 1
        if self._cooldown is None:
            out = float("inf")
        else:
            low, high = self._cooldown
            out = min(high, max(low, low * 2 ** (count - 1) + self._rng.random() * low))
        self._until[host] = self._clock() + out
        return out

    def blocks(self, host):
        """Whether no new worker may start on ``host`` now."""
        return self._clock() < self._until.get(host, float("-inf"))


class Rounds:
    """The rounds of one elastic job (:mod:`hora.rendezvous.rounds`) as its launcher writes them
    to the job's store: the current round's members in rank order, since when the job has
    had fewer than ``min_np`` workers, and whether it re-formed more often than allowed.
    ``hora run``'s :class:`ElasticJob` and Ray's elastic executor both keep their rounds here.

    Args:
        store: where the rounds go: anything with ``put(key, value)`` (the job's
            :class:`~hora.rendezvous.RendezvousServer`).
        min_np, max_np, reset_limit: as :class:`ElasticSettings`'s.
        timeout_s: how long the job may stay short of ``min_np`` (for log lines; the
            launcher's loop decides).
        min_name: how log lines name ``min_np`` (the launcher's flag, an API's argument).
    """

    def __init__(self, store, min_np, max_np=None, reset_limit=None, timeout_s=None,
                 min_name="--min-np"):
        self.store = store
        self.min_np = min_np
        self.max_np = max_np
        self.reset_limit = reset_limit
        self.timeout_s = timeout_s
        self.min_name = min_name
        self.number = -1            # the newest round written (-1: none yet)
        self.order = []             # its members (worker ids), in rank order
        self.short_since = None     # monotonic time the job fell below min_np, or None
        self.over_limit = False     # a round past reset_limit was wanted: stop the job

    def reform(self, live, hosts, change, added=()):
        """Write the next round, of the workers in ``live`` (placed and running): the current
        round's members still live, in their order, then ``added``, then the rest, at most
        ``max_np`` of them.  With fewer than ``min_np``, write nothing and note since when
        the job has been short.  ``hosts``: worker id -> host.  Returns whether a round was
        written."""
        order = [w for w in self.order if w in live]
        order += [w for w in added if w not in order]
        order += [w for w in live if w not in order]
        if len(order) < self.min_np:
            self.note_short(len(order))
            return False
        self.short_since = None
        if self.max_np is not None:
            order = order[:self.max_np]
        return self.publish(order, hosts, change if self.number >= 0 else "start")

    def note_short(self, count):
        """The job has ``count`` workers, fewer than ``min_np``: start the clock (once)."""
        if self.short_since is None:
            self.short_since = time.monotonic()
            log.warning("elastic: %d worker(s) left, fewer than %s %d; waiting%s for more",
                        count, self.min_name, self.min_np,
                        f" up to {self.timeout_s:g} s" if self.timeout_s is not None else "")

    def short_for(self, now=None):
        """Seconds the job has been short of ``min_np`` workers (0: it is not)."""
        if self.short_since is None:
            return 0.0
        return (time.monotonic() if now is None else now) - self.short_since

    def publish(self, order, hosts, change):
        """Write round ``number + 1`` of ``order`` (worker ids in rank order; ``hosts``: worker
        id -> host); unless it would be a reset past ``reset_limit``: then set
        ``over_limit`` and write nothing.  Returns whether the round was written."""
        if change != "start" and self.reset_limit is not None and \
                self.number + 1 > self.reset_limit:
            self.over_limit = True          # the launcher's loop stops the job
            return False
        self.number += 1
        self.order = list(order)
        record = round_record(self.number, [(w, hosts[w]) for w in order], change)
        self.store.put(f"{ROUND_PREFIX}{self.number}", record)
        self.store.put(LATEST_KEY, self.number)
        log.log(logging.INFO if change == "start" else logging.WARNING,
                "elastic: round %d (%s): %d worker(s): %s", self.number, change, len(order),
                ", ".join(f"{w}@{hosts[w]}" for w in order))
        return True


def free_slots(hosts, used, blacklist, count):
    """Up to ``count`` free slots of ``hosts`` (HostSpecs, in order) that ``blacklist`` does
    not block, as host names (one entry a slot), in host order; ``used``: host -> slots
    taken."""
    out = []
    for spec in hosts:
        if blacklist.blocks(spec.hostname):
            continue
        free = spec.slots - used.get(spec.hostname, 0)
        while free > 0 and len(out) < count:
            out.append(spec.hostname)
            free -= 1
    return out


def elastic_job_env(env, timeout_s):
    """``env`` (a :func:`~hora.runner.contract.job_env`) made an elastic job's: no rank or
    size (rounds give them), ``HORA_ELASTIC`` and the elastic timeout."""
    env = dict(env)
    for name in ("HORA_RANK", "HORA_SIZE", "HOROVOD_RANK", "HOROVOD_SIZE"):
        env.pop(name, None)
    env.update({"HORA_ELASTIC": "1", "HOROVOD_ELASTIC": "1",
                "HORA_ELASTIC_TIMEOUT": repr(float(timeout_s))})
    return env


def elastic_worker_env(base_env, wid, host, addr, port, secret, job_id):
    """The environment of elastic worker ``wid`` on ``host``: ``base_env`` (an
    :func:`elastic_job_env`), the job's rendezvous and identity, its name
    (``HORA_ELASTIC_ID``), and no placement: its rank comes with each round."""
    slot = SlotInfo(host, wid, 0, 1, 0, 1, 0)
    env = worker_env(slot, base_env, addr, port, secret, job_id)
    for name in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE"):
        env.pop(f"HORA_{name}", None)
        env.pop(f"HOROVOD_{name}", None)
    env["HORA_ELASTIC_ID"] = str(wid)
    return env


@dataclasses.dataclass
class _Member:
    """One worker process of the elastic job."""
    wid: int
    host: str
    worker: object              # the supervisor's Worker
    placed: bool = False        # named in a round
    leaving: bool = False       # stopped by us (its host was removed, or the job finishes)


class ElasticJob(Job):
    """One elastic run of ``config.command``.  Use once: ``ElasticJob(config, elastic).run()``.

    ``config.np`` workers start (fewer if the hosts have fewer slots, but at least
    ``min_np``); ``config.hosts``/``config.hostfile`` are the fixed hosts when there is no
    discovery script.
    """

    def __init__(self, config, elastic):
        # no Job.__init__: the slots come from discovery as the job goes
        self.config = config
        self.elastic = elastic
        if elastic.discovery_script and (config.hosts or config.hostfile):
            raise ValueError("--host-discovery-script and -H/--hostfile exclude each other")
        if config.np < elastic.min_np or (elastic.max_np is not None
                                          and config.np > elastic.max_np):
            raise ValueError(f"-np {config.np} must lie within --min-np {elastic.min_np} and "
                             f"--max-np {elastic.max_np}")
        self._discovery = (Discovery(elastic.discovery_script, elastic.slots)
                           if elastic.discovery_script else None)
        self._fixed = None
        if self._discovery is None:
            if config.hostfile:
                self._fixed = parse_hostfile(config.hostfile)
            elif config.hosts:
                self._fixed = (parse_hosts(config.hosts) if isinstance(config.hosts, str)
                               else list(config.hosts))
            else:
                self._fixed = [HostSpec("localhost", elastic.max_np or config.np)]
        self.network_interface = one_interface(config.network_interface)
        self.ssh = config.ssh or SshSettings()
        self.job_id = uuid.uuid4().hex[:12]
        self.remote_hosts = []
        self._supervisor = None
        self._members = {}          # wid -> _Member
        self._rounds = None         # Rounds, once the store serves
        self._next_wid = 0
        self._shared = None         # remote.Multiplex, made by the start-up check
        self._layout_told = False           # a refused fixed layout was said (_fixed_layout_on)
        self._blacklist = Blacklist(elastic.cooldown)
        self._hosts = []            # the hosts available now (HostSpecs)
        self._finishing = False
        self._last_failure = None
        self._failed_of_itself = False      # the last worker lost exited non-zero of itself
        self._server = None
        self._base_env = None
        self._addr = None

    # -- the whole life of an elastic job ------------------------------------------------------
    def run(self):
        """Run the elastic job to its end; return a :class:`~hora.runner.launcher.JobResult`.

        Raises:
            HoraError: the first discovery failed.
            HostCheckError: a remote host failed its start-up check.
            OpenFilesLimitError: this process may not open the files ``max_np`` ranks need
                (``np`` without a ``max_np``).
        """
        if self._supervisor is not None:
            raise RuntimeError("an ElasticJob runs once; make a new one")
        config = self.config
        reserve_open_files(0, max(config.np, self.elastic.max_np or 0, 1))   # (any may be remote)
        self._hosts = self._discovery.poll() if self._discovery else list(self._fixed)
        self.remote_hosts = [h.hostname for h in self._hosts if not is_local_host(h.hostname)]
        secret = new_secret()
        self._addr = self._meeting_address()
        listen = "0.0.0.0" if (self.remote_hosts or self._discovery) else self._addr
        pump = OutputPump(max(config.np, self.elastic.max_np or 0, 1), config.prefix_output,
                          config.output_filename)
        self._supervisor = supervisor = Supervisor(config.grace_s, output=pump)
        self._server = server = RendezvousServer(secret, host=listen, port=0).start()
        self._rounds = Rounds(server, self.elastic.min_np, self.elastic.max_np,
                              self.elastic.reset_limit, self.elastic.timeout_s)
        env = elastic_job_env(job_env(os.environ, config.env, self.network_interface,
                                      config.start_timeout), self.elastic.timeout_s)
        if config.monitor:
            env["HORA_MONITOR"] = "1"
        self._base_env = (env, secret)
        started = time.monotonic()
        try:
            with serving(server, config), supervisor:
                self._start_initial()
                return self._watch(started)
        finally:
            if self._discovery is not None:
                self._discovery.close()
            server.stop()
            self._end_sharing()

    def _start_initial(self):
        want = self.config.np
        for host in self._free_slots(want):
            self._spawn(host)
        members = list(self._members)
        if len(members) < self.elastic.min_np:
            log.warning("elastic: the hosts have %d slot(s) for -np %d; waiting up to %g s "
                        "(--elastic-timeout) for --min-np %d", len(members), want,
                        self.elastic.timeout_s, self.elastic.min_np)
            self._rounds.short_since = time.monotonic()
            return
        for wid in members:
            self._members[wid].placed = True
        self._rounds.publish(members, self._hosts_of(), "start")

    def _watch(self, started):
        supervisor = self._supervisor
        next_discovery = time.monotonic() + DISCOVERY_PERIOD_S
        while True:
            exits, signum = supervisor.watch(_TICK_S)
            if signum is not None:
                log.error("received %s; stopping all workers", signal.Signals(signum).name)
                supervisor.stop(signum)
                return self._result(128 + signum, signum)
            for ex in exits:
                self._on_exit(ex)
            if not supervisor.running():
                if self._nothing_to_wait_for():
                    return self._final()
                self._rounds.note_short(0)      # bounds the wait (once; a no-op if short)
            if self.config.timeout_s is not None and \
                    time.monotonic() - started > self.config.timeout_s:
                self._timed_out(supervisor.running())
            if self._finishing:
                continue
            now = time.monotonic()
            if self._discovery is not None:
                hosts = self._discovery.collect()
                if hosts is not None:
                    next_discovery = now + DISCOVERY_PERIOD_S
                    self._on_hosts(hosts)
                elif now >= next_discovery and not self._discovery.running:
                    self._discovery.start()
            self._top_up()
            self._admit_ready()
            if self._rounds.short_for(now) > self.elastic.timeout_s:
                return self._give_up(f"hora: the elastic job has {len(self._live())} "
                                     f"worker(s), fewer than --min-np {self.elastic.min_np}, "
                                     f"and not enough came back within "
                                     f"{self.elastic.timeout_s:g} s (--elastic-timeout)")
            if self._rounds.over_limit:
                return self._give_up(RESET_LIMIT_MESSAGE.format(
                    resets=self._rounds.number + 1, limit=self.elastic.reset_limit))

    # -- events -------------------------------------------------------------------------------
    def _on_exit(self, ex):
        member = self._members.get(ex.rank)
        if member is None:
            return
        if ex.returncode == 0:
            if not self._finishing:
                log.info("elastic: worker %d finished; the job is finishing", member.wid)
                self._finishing = True
                for other in self._members.values():
                    if not other.placed and other.worker.state is WorkerState.RUNNING:
                        other.leaving = True
                        other.worker.signal(signal.SIGTERM)
            return
        if member.leaving:
            return
        self._last_failure = ex
        # 255: ssh lost the host; a signal: the worker was lost, it did not fail of itself
        self._failed_of_itself = ex.returncode > 0 and ex.returncode != 255
        out = self._blacklist.add(member.host)
        log.warning("elastic: worker %d on %s failed (%s); %s", member.wid, member.host,
                    ex.describe(), f"no new worker starts on {member.host} for {out:.1f} s"
                    if out != float("inf") else f"no new worker starts on {member.host}")
        if self._finishing:
            return
        if member.placed and member.wid in self._rounds.order:
            self._reform("removed")

    def _on_hosts(self, hosts):
        """A discovery run's answer: stop the workers of hosts it no longer lists."""
        names = {h.hostname for h in hosts}
        gone = [m for m in self._members.values()
                if m.worker.state is WorkerState.RUNNING and not m.leaving
                and m.host not in names]
        self._hosts = hosts
        if not gone:
            return
        self._failed_of_itself = False
        for m in gone:
            log.warning("elastic: host %s left the discovery output; stopping worker %d",
                        m.host, m.wid)
            m.leaving = True
            m.worker.signal(signal.SIGTERM)
        if any(m.placed for m in gone):
            self._reform("removed")

    def _top_up(self):
        """Start workers on free, usable slots, up to max_np (as discovery allows)."""
        if self._discovery is None:
            return                      # a fixed host list only shrinks
        limit = self.elastic.max_np or float("inf")
        live = len(self._live())
        if live >= limit:
            return
        for host in self._free_slots(int(min(limit - live, 1 << 16))):
            self._spawn(host)

    def _admit_ready(self):
        """Put the started workers that reached init() into a new round."""
        ready = [m.wid for m in self._members.values()
                 if not m.placed and not m.leaving and m.worker.state is WorkerState.RUNNING
                 and self._server.get(f"{READY_PREFIX}{m.wid}") is not None]
        if ready:
            for wid in ready:
                self._members[wid].placed = True
            self._reform("added", added=ready)

    def _reform(self, change, added=()):
        """Write a new round: the live placed workers in their old order, then ``added``."""
        self._rounds.reform(self._placed_live(), self._hosts_of(), change, added)

    def _hosts_of(self):
        return {w: m.host for w, m in self._members.items()}

    # -- bookkeeping --------------------------------------------------------------------------
    def _live(self):
        return [w for w, m in self._members.items()
                if m.worker.state is WorkerState.RUNNING and not m.leaving]

    def _placed_live(self):
        return [w for w in self._live() if self._members[w].placed]

    def _nothing_to_wait_for(self):
        """With no worker left: whether to end now rather than wait for hosts.  Waiting
        makes sense only when discovery may bring hosts and the last worker was lost (a
        signal, its host gone from the discovery output) or none has started yet, not when
        it failed of itself (its exit code: a bug would fail every new worker too)."""
        return self._finishing or self._discovery is None or self._failed_of_itself

    def _free_slots(self, count):
        """Up to ``count`` hosts (one entry a slot) with a free slot, in host order."""
        used = {}
        for w in self._live():
            used[self._members[w].host] = used.get(self._members[w].host, 0) + 1
        return free_slots(self._hosts, used, self._blacklist, count)

    def _host_slots(self):
        return {h.hostname: h.slots for h in self._hosts}

    def _fixed_layout_on(self, host):
        """Whether the worker about to start on ``host`` starts without address-space
        randomization (:func:`hora.runner.proc.layout_hosts`).  Under ``auto`` only a
        worker of this machine can: the CPUs of an elastic job's other hosts are not
        checked (they come and go), so their workers keep it."""
        count = 1 + sum(1 for w in self._live() if self._members[w].host == host)
        local = is_local_host(host)
        machine = self._this_machine() if local else ("", 0)
        policy = self._layout_policy()
        if host not in proc.layout_hosts(policy, {host: count}, {host: machine}):
            return False
        why = proc.fixed_layout_refused() if local else None
        if why and not self._layout_told:
            self._layout_told = True
            self._tell_refused(policy, {host: why})
        return not why

    def _spawn(self, host):
        wid = self._next_wid
        self._next_wid += 1
        env, secret = self._base_env
        slot = SlotInfo(host, wid, 0, 1, 0, 1, 0)
        wenv = elastic_worker_env(env, wid, host, self._addr, self._server.port, secret,
                                  self.job_id)
        fixed = self._fixed_layout_on(host)
        if is_local_host(host):
            worker = self._supervisor.spawn(wid, host, self.config.command, wenv,
                                            name=f"worker {wid}", fixed_layout=fixed)
        else:
            worker = self._start_remote(slot, wenv, env, fixed)
            worker.name = f"worker {wid}"
        self._members[wid] = _Member(wid, host, worker)
        log.debug("started worker %d (pid %d) on %s", wid, worker.pid, host)
        return wid


    # -- endings ------------------------------------------------------------------------------
    def _give_up(self, message):
        log.error("%s", message)
        print(message, file=sys.stderr, flush=True)
        self._supervisor.stop(signal.SIGTERM)
        return self._result(EXIT_FAILED)

    def _final(self):
        """Every worker has exited: success when the job was finishing and every worker
        placed at the end exited 0."""
        last = [self._members[w].worker.exit for w in self._rounds.order
                if w in self._members]
        if self._finishing and all(e is not None and e.returncode == 0 for e in last
                                   if not self._members[e.rank].leaving):
            return self._result(0)
        failure = self._last_failure
        code = EXIT_FAILED if failure is None else (
            failure.returncode if failure.returncode > 0 else 128 - failure.returncode)
        message = (f"hora: every worker of the elastic job has exited; the last to fail: "
                   f"{failure.describe()}" if failure is not None
                   else "hora: every worker of the elastic job has exited")
        log.error("%s", message)
        return self._result(code)

    def _result(self, code, signum=None):
        exits = [m.worker.exit for m in self._members.values()]
        return JobResult(exitcode=code, failure=self._last_failure, signal=signum,
                         exits=exits, store=self._server.items())

