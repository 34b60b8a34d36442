"""Ray, elastic: a hora job on Ray actors that shrinks and grows as the actors die and the
cluster changes (Horovod's ``horovod.ray.ElasticRayExecutor`` API).

    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=8)
    executor = ElasticRayExecutor(settings, cpus_per_slot=1)
    executor.start()                      # waits for min_num_proc slots
    results = executor.run(train)         # train() calls hora.init() and hvd.elastic.run
    executor.shutdown()

The executor's process plays the part of ``hora run``'s elastic launcher
(:mod:`hora.runner.elastic`): it serves the job's rendezvous store, starts one Ray actor per
slot that discovery reports, and forms the job in rounds (:mod:`hora.core.membership`), kept
with the launcher's own :class:`~hora.runner.elastic.Rounds` and
:class:`~hora.runner.elastic.Blacklist`.  The training function is an elastic script's, run
in each actor: it calls ``hora.init()`` (which waits for a round that names its actor), wraps
its loop in ``hvd.elastic.run`` and commits a State.  Then:

- an actor dies (killed, its process killed, its node lost) or its function raises: the
  actor is killed, its host is kept out for ``cooldown_range`` (without one, for the rest of
  the run), and a round with the survivors is written at once; they restore their last
  commit and carry on in the same processes;
- discovery (polled about once a second) reports more slots: new actors start there, up to
  ``max_num_proc``, and join at the running workers' next ``state.commit()``;
- a host leaves discovery's answer: its actors are killed and a round without them is
  written;
- fewer than ``min_num_proc`` workers for ``elastic_timeout`` seconds, or more resets than
  ``reset_limit``: :meth:`ElasticRayExecutor.run` raises (:class:`~hora.errors.ElasticTimeoutError`,
  :class:`~hora.errors.ElasticJobError`) and every actor is killed;
- a worker's function returns: the job is finishing; no round is written any more, and
  ``run`` returns the values of every rank of that worker's round, in rank order, once they
  have all returned (one of them failing fails the call: :class:`~hora.errors.WorkerFailedError`
  naming its rank, host and actor).

Discovery: by default :class:`RayHostDiscovery` lists Ray's live nodes with
``CPU // cpus_per_slot`` slots each (with ``use_gpu``, at most ``GPU // gpus_per_slot``).  To
use another, set ``settings.discovery`` and pass ``override_discovery=False``; it may be any
object with Horovod's ``find_available_hosts_and_slots()`` method, or a function of no
arguments, that returns ``{host: slots}``.  A host that names a Ray node (its address, its
node id, or a ``node:<host>`` custom resource of it, as in Horovod's tests) pins its actors
to that node; any other name is a logical host whose actors Ray may place anywhere.

Values rank 0 passes to :func:`hora.ray.report` reach ``run(callbacks=...)`` (rank 0 may be a
different actor after each round).

Layer: integrations.  ``ray`` is imported lazily; imports the runner's elastic helpers, the
rendezvous server, core's membership names, and :mod:`hora.integrations.ray`'s worker.
"""
import concurrent.futures
import dataclasses
import functools
import logging
import math
import os
import pickle
import time
import uuid
import warnings

from ..config import remove_segments_of
from ..core.membership import READY_PREFIX, ROUND_PREFIX
from ..errors import (CollectiveTimeoutError, ElasticJobError, ElasticTimeoutError, HoraError,
                      WorkerFailedError)
from ..rendezvous import RendezvousServer, new_secret
from ..runner.contract import job_env
from ..runner.discovery import DISCOVERY_PERIOD_S, DISCOVERY_TIMEOUT_S
from ..runner.elastic import (Blacklist, Rounds, elastic_job_env, elastic_worker_env,
                              free_slots)
from ..runner.hosts import HostSpec
from .ray import REPORT_PREFIX, BaseHoraWorker

__all__ = ["ElasticRayExecutor", "ElasticRaySettings", "RayHostDiscovery"]

log = logging.getLogger(__name__)

_TICK_S = 0.2           # the driver's loop: actors' ends wake it at once
# Horovod's settings that mean nothing here (ssh, mpirun, its output handling)
_IGNORED_SETTINGS = frozenset({"ssh_port", "extra_mpi_args", "tcp_flag", "binding_args", "key",
                               "output_filename", "run_func_mode",
                               "prefix_output_with_timestamp", "num_proc", "start_timeout"})


@dataclasses.dataclass
class ElasticRaySettings:
    """How an :class:`ElasticRayExecutor` runs (Horovod's ``ElasticSettings``); make one with
    :meth:`ElasticRayExecutor.create_settings`.  Mutable, as Horovod's: a caller may set
    ``discovery`` before passing ``override_discovery=False``.

    Attributes:
        min_num_proc: the job runs with no fewer workers; with fewer it waits for more, up to
            ``elastic_timeout``.
        max_num_proc: it never runs more (None: as many as discovery reports slots).
        reset_limit: stop after this many resets (rounds after the first); None: no limit.
        elastic_timeout: seconds the job may have fewer than ``min_num_proc`` workers.  A
            worker waits ``elastic_timeout + timeout_s`` to be placed in a round
            (``HORA_ELASTIC_TIMEOUT``), so that the driver, not a waiting worker, gives up
            first.
        timeout_s: seconds an actor has to start, and the ranks of a round to meet
            (``HORA_START_TIMEOUT``).
        cooldown_range: ``(min_s, max_s)``: a host whose worker failed gets no new actor for
            ``min_s * 2**(failures-1)`` plus up to ``min_s`` at random, at most ``max_s``
            seconds; None: not again in this run.
        nics: network interfaces the data plane may use (``HORA_IFACE``: the first in sorted
            order), or None.
        discovery: what lists the hosts and their slots (see the module's notes); set by the
            executor unless ``override_discovery=False``.
        shutdown_timeout_s: seconds the final workers get to leave the job at the end.
        ssh_identity_file, verbose: accepted for Horovod's callers; Ray starts the workers,
            and logging shows the executor's steps.
    """
    min_num_proc: int = 1
    max_num_proc: "int | None" = None
    reset_limit: "int | None" = None
    elastic_timeout: float = 600.0
    timeout_s: float = 30.0
    cooldown_range: "tuple | None" = None
    nics: "frozenset | None" = None
    discovery: object = None
    shutdown_timeout_s: float = 10.0
    ssh_identity_file: "str | None" = None
    verbose: int = 1

    @property
    def num_proc(self):
        """Workers :meth:`ElasticRayExecutor.start` waits for slots for (Horovod's name)."""
        return self.min_num_proc

    def check(self):
        """Raise ValueError for settings that cannot run."""
        def positive_int(name, value, allow_none=False, minimum=1):
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"ElasticRayExecutor: {name} must be an integer >= {minimum}, "
                                 f"got {value!r}")
        positive_int("min_num_proc", self.min_num_proc)
        positive_int("max_num_proc", self.max_num_proc, allow_none=True)
        positive_int("reset_limit", self.reset_limit, allow_none=True, minimum=0)
        if self.max_num_proc is not None and self.max_num_proc < self.min_num_proc:
            raise ValueError(f"ElasticRayExecutor: max_num_proc {self.max_num_proc} is less "
                             f"than min_num_proc {self.min_num_proc}")
        for name in ("elastic_timeout", "timeout_s", "shutdown_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ElasticRayExecutor: {name} must be positive, got "
                                 f"{getattr(self, name)!r}")
        if self.cooldown_range is not None:
            low, high = self.cooldown_range
            if not 0 < low <= high:
                raise ValueError(f"ElasticRayExecutor: cooldown_range {self.cooldown_range!r}: "
                                 f"expected (min_s, max_s) with 0 < min_s <= max_s")


class RayHostDiscovery:
    """Ray's live nodes as hosts (Horovod's class of that name): ``{address: slots}``, where
    a node's slots are its ``CPU`` count over ``cpus_per_slot`` and, with ``use_gpu``, at
    most its ``GPU`` count over ``gpus_per_slot``.  Nodes without a slot are left out.  Two
    nodes with one address (a cluster of nodes on one machine) are told apart as
    ``address-<node id prefix>``.

    The whole cluster is taken to be the job's, as Horovod takes it: the counts are the
    nodes' totals, not what other Ray work leaves free.
    """

    def __init__(self, use_gpu=False, cpus_per_slot=1, gpus_per_slot=1):
        self.use_gpu = use_gpu
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = gpus_per_slot

    def find_available_hosts_and_slots(self):
        """``{host: slots}`` of the live nodes with at least one slot."""
        out = {}
        for name, node in _ray_nodes().items():
            resources = node.get("Resources", {})
            slots = (resources.get("CPU", 0) // self.cpus_per_slot if self.cpus_per_slot
                     else math.inf)
            if self.use_gpu:
                slots = min(slots, resources.get("GPU", 0) // (self.gpus_per_slot or 1))
            if slots and slots != math.inf:
                out[name] = int(slots)
        return out


def _ray_nodes():
    """``{host name: node}`` of Ray's live nodes: a node by its address, or
    ``address-<node id prefix>`` where several nodes share one."""
    import ray
    nodes = [n for n in ray.nodes() if n.get("Alive", n.get("alive"))]
    count = {}
    for n in nodes:
        count[n["NodeManagerAddress"]] = count.get(n["NodeManagerAddress"], 0) + 1
    return {(n["NodeManagerAddress"] if count[n["NodeManagerAddress"]] == 1
             else f"{n['NodeManagerAddress']}-{n['NodeID'][:8]}"): n for n in nodes}


def _scheduling(host):
    """The Ray actor options that put an actor on ``host``: the node of that name (address,
    ``address-<prefix>`` or node id), the node that has a ``node:<host>`` resource, or none
    (a logical host)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    nodes = _ray_nodes()
    node = nodes.get(host) or next((n for n in nodes.values() if n["NodeID"] == host), None)
    if node is not None:
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node["NodeID"],
                                                                      soft=False)}
    if any(f"node:{host}" in n.get("Resources", {}) for n in nodes.values()):
        return {"resources": {f"node:{host}": 0.01}}
    return {}


class _Discovery:
    """Calls the discovery with a deadline: the first failure is fatal, later ones are logged
    and the hosts found before are kept (as ``hora run``'s discovery script)."""

    def __init__(self, discovery, timeout_s=DISCOVERY_TIMEOUT_S):
        find = getattr(discovery, "find_available_hosts_and_slots", discovery)
        if not callable(find):
            raise TypeError(f"ElasticRayExecutor: settings.discovery must have "
                            f"find_available_hosts_and_slots() or be callable, got "
                            f"{discovery!r}")
        self.discovery = discovery
        self._find = find
        self._timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "hora-ray-discovery")
        self._pending = None
        self.hosts = None           # the last good answer: HostSpecs

    def poll(self):
        """Ask the discovery; return its hosts (the last good ones when this answer failed or
        is late)."""
        if self._pending is None:
            self._pending = self._pool.submit(self._find)
        try:
            found = self._pending.result(timeout=self._timeout_s)
            hosts = _host_specs(found)
        except concurrent.futures.TimeoutError:
            return self._failed(f"no answer within {self._timeout_s:g} s", keep_pending=True)
        except Exception as e:  # noqa: BLE001 - a user's discovery may raise anything
            self._pending = None
            return self._failed(f"{type(e).__name__}: {e}", cause=e)
        self._pending = None
        self.hosts = hosts
        return hosts

    def _failed(self, why, cause=None, keep_pending=False):
        message = f"ElasticRayExecutor: discovery {self.discovery!r}: {why}"
        if not keep_pending:
            self._pending = None
        if self.hosts is None:
            raise HoraError(message) from cause
        log.warning("%s; keeping the hosts found before", message)
        return self.hosts

    def close(self):
        self._pool.shutdown(wait=False)


def _host_specs(found):
    """HostSpecs of a discovery's answer: ``{host: slots}`` (or ``(host, slots)`` pairs);
    hosts without a slot are left out."""
    items = found.items() if hasattr(found, "items") else found
    specs = []
    for host, slots in items:
        if not isinstance(host, str) or not host or isinstance(slots, bool) or \
                not isinstance(slots, int) or slots < 0:
            raise ValueError(f"expected {{host: slots}}, got {host!r}: {slots!r}")
        if slots:
            specs.append(HostSpec(host, slots))
    return specs


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


class ElasticRayExecutor:
    """An elastic hora job on Ray actors, with Horovod's ``ElasticRayExecutor`` API: see the
    module's notes for how it forms, shrinks and grows.

    Example:
        >>> def train():
        ...     import hora.torch as hvd
        ...     hvd.init()
        ...     state = hvd.elastic.TorchState(model, optimizer, epoch=0)
        ...     @hvd.elastic.run
        ...     def loop(state):
        ...         for state.epoch in range(state.epoch, 10):
        ...             ...                      # one epoch
        ...             state.commit()
        ...         return state.epoch
        ...     return loop(state)
        >>> settings = ElasticRayExecutor.create_settings(min_num_proc=2)   # doctest: +SKIP
        >>> executor = ElasticRayExecutor(settings, cpus_per_slot=1)       # doctest: +SKIP
        >>> executor.start()                                               # doctest: +SKIP
        >>> executor.run(train)                                            # doctest: +SKIP
        [10, 10, 10, 10]

    Args:
        settings: an :class:`ElasticRaySettings` (:meth:`create_settings`).
        use_gpu: give every worker ``gpus_per_slot`` GPUs (default 1), and count slots by
            GPUs too.  Each actor sees the GPUs Ray gave it (Ray's ``CUDA_VISIBLE_DEVICES``):
            its device is ``cuda:0``, whatever its ``local_rank()``.
        cpus_per_slot: CPUs Ray reserves for each worker (and per slot in discovery).
        gpus_per_slot: GPUs per worker, with ``use_gpu``.
        env_vars: more environment variables for the workers.
        override_discovery: replace ``settings.discovery`` with a :class:`RayHostDiscovery`
            of these resources (Horovod's default); False keeps the caller's.

    Raises:
        ValueError: ``gpus_per_slot`` without ``use_gpu``, non-positive resources, or
            settings that cannot run.
    """

    @staticmethod
    def create_settings(min_num_proc=1, max_num_proc=None, reset_limit=None,
                        elastic_timeout=600, timeout_s=30, ssh_identity_file=None, nics=None,
                        cooldown_range=None, min_np=None, max_np=None, **kwargs):
        """The settings of an elastic executor (Horovod's signature; see
        :class:`ElasticRaySettings` for each).  ``min_np`` and ``max_np`` are Horovod's
        deprecated names of ``min_num_proc`` and ``max_num_proc``.  Of Horovod's other
        settings, ``verbose`` is accepted and those of ssh and mpirun are ignored;
        ``shutdown_timeout_s`` is hora's.

        Raises:
            ValueError: settings that cannot run.
            TypeError: an unknown keyword.
        """
        if min_np is not None:
            warnings.warn("create_settings(min_np=...) is deprecated; use min_num_proc",
                          DeprecationWarning, stacklevel=2)
            min_num_proc = min_np
        if max_np is not None:
            warnings.warn("create_settings(max_np=...) is deprecated; use max_num_proc",
                          DeprecationWarning, stacklevel=2)
            max_num_proc = max_np
        extra = {}
        for name, value in kwargs.items():
            if name in ("verbose", "shutdown_timeout_s"):
                extra[name] = value
            elif name not in _IGNORED_SETTINGS:
                raise TypeError(f"ElasticRayExecutor.create_settings(): unknown setting "
                                f"{name!r}")
        if isinstance(nics, str):
            nics = {nics}
        settings = ElasticRaySettings(
            min_num_proc=min_num_proc, max_num_proc=max_num_proc, reset_limit=reset_limit,
            elastic_timeout=float(elastic_timeout), timeout_s=float(timeout_s),
            cooldown_range=tuple(cooldown_range) if cooldown_range else None,
            nics=frozenset(nics) if nics else None, ssh_identity_file=ssh_identity_file,
            **extra)
        settings.check()
        return settings

    def __init__(self, settings, use_gpu=False, cpus_per_slot=1, gpus_per_slot=None,
                 env_vars=None, override_discovery=True):
        if gpus_per_slot and not use_gpu:
            raise ValueError("ElasticRayExecutor: gpus_per_slot is set but use_gpu is False")
        gpus_per_slot = gpus_per_slot or int(bool(use_gpu))
        if use_gpu and gpus_per_slot < 1:
            raise ValueError(f"ElasticRayExecutor: gpus_per_slot must be >= 1, got "
                             f"{gpus_per_slot!r}")
        if cpus_per_slot < 0 or (cpus_per_slot == 0 and not use_gpu):
            raise ValueError(f"ElasticRayExecutor: cpus_per_slot must be positive (or 0 "
                             f"with use_gpu), got {cpus_per_slot!r}")
        self.settings = settings if settings is not None else ElasticRaySettings()
        self.settings.check()
        if override_discovery:
            self.settings.discovery = RayHostDiscovery(use_gpu=use_gpu,
                                                       cpus_per_slot=cpus_per_slot,
                                                       gpus_per_slot=gpus_per_slot)
        self.use_gpu = bool(use_gpu)
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = gpus_per_slot if use_gpu else 0
        self.env_vars = dict(env_vars or {})
        self.workers = []           # this or the last run's workers, in the order started
        self.rounds = []            # the last run's rounds, as written to its store
        self._discovery = None

    # -- start -------------------------------------------------------------------------------
    def start(self):
        """Check Ray and the discovery, and wait until it reports ``min_num_proc`` slots.

        Raises:
            HoraError: the discovery's first answer failed, or the executor was started
                already.
            ElasticTimeoutError: fewer than ``min_num_proc`` slots for ``elastic_timeout``
                seconds.
        """
        import ray
        if self._discovery is not None:
            raise HoraError("ElasticRayExecutor.start(): already started; call shutdown() "
                            "first")
        if ray.util.client.ray.is_connected():
            raise NotImplementedError("ElasticRayExecutor does not run over Ray Client "
                                      "(ray://); run the driver on a node of the cluster")
        if not ray.is_initialized():
            ray.init()
        if self.settings.discovery is None:
            raise HoraError("ElasticRayExecutor: settings.discovery is None; set it, or pass "
                            "override_discovery=True")
        discovery = _Discovery(self.settings.discovery)
        try:
            want = self.settings.min_num_proc
            deadline = time.monotonic() + self.settings.elastic_timeout
            while True:
                hosts = discovery.poll()
                slots = sum(h.slots for h in hosts)
                if slots >= want:
                    break
                if time.monotonic() >= deadline:
                    raise ElasticTimeoutError(
                        f"ElasticRayExecutor.start(): discovery reports {slots} slot(s), "
                        f"fewer than min_num_proc {want}, after "
                        f"{self.settings.elastic_timeout:g} s (elastic_timeout)",
                        workers=slots, min_workers=want)
                time.sleep(min(DISCOVERY_PERIOD_S, max(0.0, deadline - time.monotonic())))
        except BaseException:
            discovery.close()
            raise
        log.debug("elastic Ray executor: %s", ", ".join(f"{h.hostname}:{h.slots}"
                                                        for h in hosts))
        self._discovery = discovery

    # -- run ---------------------------------------------------------------------------------
    def run(self, worker_fn, callbacks=None, timeout_s=None):
        """Run the elastic job: ``worker_fn()`` on every worker, until the workers of one
        round have all returned; return their values in that round's rank order.

        Args:
            worker_fn: a function of no arguments that calls ``hora.init()`` and trains in
                ``hvd.elastic.run`` (it runs in Ray actors: it must pickle).
            callbacks: functions called with each value rank 0 passes to
                :func:`hora.ray.report`, in the order reported.
            timeout_s: seconds the whole run may take (None: no limit).

        Raises:
            WorkerFailedError: every worker failed, the first of them by raising; or a
                worker of the final round failed after another had returned.  Names its rank,
                host and actor.
            ElasticTimeoutError: fewer than ``min_num_proc`` workers for ``elastic_timeout``
                seconds.
            ElasticJobError: more resets than ``reset_limit``.
            CollectiveTimeoutError: ``timeout_s`` passed.
        """
        if self._discovery is None:
            raise HoraError("ElasticRayExecutor: not started; call start() first")
        job = _ElasticRun(self, worker_fn, list(callbacks or ()), timeout_s)
        self.workers, self.rounds = [], []
        try:
            return job.run()
        finally:
            job.close()
            self.rounds = job.records()

    # -- shutdown ----------------------------------------------------------------------------
    def shutdown(self):
        """Forget the discovery; :meth:`start` may be called again.  (Every run kills its
        actors and closes its rendezvous as it ends.)  Safe to call twice."""
        if self._discovery is not None:
            self._discovery.close()
            self._discovery = None


class _ElasticRun:
    """One :meth:`ElasticRayExecutor.run`: the driver's loop, in the caller's thread."""

    def __init__(self, executor, worker_fn, callbacks, timeout_s):
        self.ex = executor
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
        self.hosts = self.ex._discovery.poll()
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
        self.hosts = self.ex._discovery.poll()
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
                       max_restarts=0, **_scheduling(host))
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
