"""Ray: a hora job whose ranks are Ray actors (Horovod's ``horovod.ray.RayExecutor`` API).

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
    executor.start()
    results = executor.run(train, args=[config])      # fn calls hora.init() itself
    executor.shutdown()

:class:`RayExecutor` reserves a placement group (one bundle per worker, ``PACK``; or, with
``num_hosts``, one bundle per host, ``STRICT_SPREAD``, as Horovod places them), starts one
actor per worker in it, and numbers the ranks host by host (the actors' Ray node ids), so
that ranks sharing a node get consecutive ranks, a ``local_rank``/``local_size`` and
hora's shared-memory plane.  The executor's own process then plays the part ``hora run``
plays: it serves a :class:`~hora.rendezvous.RendezvousServer` with a fresh secret and writes
every actor the ``HORA_*`` environment contract (:func:`hora.runner.contract.worker_env`).
As with :func:`hora.run`, the functions the actors run call ``hora.init()`` (or
``hora.torch.init()``) themselves.

Failures: a worker whose function raises, or whose actor dies, fails the call with a
:class:`~hora.errors.WorkerFailedError` naming its rank, host and Ray actor.  The other
workers get ``grace_s`` seconds to end (a peer's death ends their collectives within
seconds); those still running after it are killed, and the executor must be started again.
Every wait of the executor has a deadline: placement, actor start-up, ``run(timeout_s=...)``
and shutdown.

Values a worker passes to :func:`report` (rank 0 only; Horovod's ``callbacks``) reach the
driver through the job's rendezvous store and are handed to ``run(callbacks=...)`` while it
waits; :mod:`hora.integrations.ray_tune` forwards them to ``ray.tune.report``.

Layer: integrations.  ``ray`` is imported lazily (it is an optional dependency); imports the
runner's contract, the rendezvous server and hora's top-level API (in the actors).
"""
import dataclasses
import functools
import logging
import os
import pickle
import socket
import time
import uuid

from ..config import remove_segments_of
from ..errors import CollectiveTimeoutError, HoraError, WorkerFailedError
from ..rendezvous import RendezvousClient, RendezvousServer, new_secret
from ..runner.contract import job_env, worker_env
from ..runner.hosts import HostSpec, assign_slots

__all__ = ["RayExecutor", "RaySettings", "BaseHoraWorker", "BaseHorovodWorker", "report"]

log = logging.getLogger(__name__)

# rendezvous keys of the values rank 0 reports (see report()), numbered from 0
REPORT_PREFIX = "ray/report/"
_POLL_S = 0.2          # how often a waiting driver looks at the workers and the reports


@dataclasses.dataclass(frozen=True)
class RaySettings:
    """How a :class:`RayExecutor` starts and waits (Horovod's ``MiniSettings``).

    Attributes:
        timeout_s: seconds for the actors to start and for every rank to reach
            ``hora.init()`` (``HORA_START_TIMEOUT`` in the actors).
        placement_group_timeout_s: seconds for Ray to reserve the workers' resources.
        nics: network interfaces the data plane may use (``HORA_IFACE``: hora binds one, the
            first in sorted order), or None for the one that reaches the rendezvous.
        grace_s: after a worker fails, seconds the others get to end before they are killed.
        shutdown_timeout_s: seconds :meth:`RayExecutor.shutdown` lets workers shut hora down.
        ssh_identity_file: accepted for Horovod's callers; Ray starts the workers, not ssh.
        verbose: accepted for Horovod's callers; use logging to see the executor's steps.
    """
    timeout_s: float = 30.0
    placement_group_timeout_s: float = 100.0
    nics: frozenset = None
    grace_s: float = 5.0
    shutdown_timeout_s: float = 10.0
    ssh_identity_file: str = None
    verbose: int = 1


class BaseHoraWorker:
    """The Ray actor of one rank: holds the executable object that :meth:`execute` passes
    to functions, and the environment the executor writes."""

    def __init__(self):
        self.executable = None

    def placement(self):
        """``(Ray node id, host name, pid, GPU ids)`` of this actor."""
        import ray
        return (ray.get_runtime_context().get_node_id(), socket.gethostname(), os.getpid(),
                [str(g) for g in ray.get_gpu_ids()])

    def update_env_vars(self, env_vars):
        """Set ``env_vars`` in this actor's environment."""
        os.environ.update({str(k): str(v) for k, v in env_vars.items()})

    def env_vars(self):
        """This actor's environment."""
        return dict(os.environ)

    def start_executable(self, executable_cls=None, executable_args=None,
                         executable_kwargs=None):
        """Make ``executable_cls(*args, **kwargs)`` the object :meth:`execute` passes on."""
        if executable_cls is not None:
            self.executable = executable_cls(*(executable_args or ()),
                                             **(executable_kwargs or {}))

    def execute(self, fn):
        """``fn(executable)``: the work of one call of the executor."""
        return fn(self.executable)

    def shutdown_hora(self):
        """Leave the hora job, if this actor joined one."""
        import hora
        if hora.is_initialized():
            hora.shutdown()


BaseHorovodWorker = BaseHoraWorker          # Horovod's name


def _call(fn, args, kwargs, _executable):
    return fn(*args, **kwargs)


def report(value, timeout=10.0):
    """From a worker: hand ``value`` to the driver's ``run(callbacks=...)`` (rank 0 only;
    the other ranks' calls do nothing, as Horovod's callbacks see rank 0's values).

    Args:
        value: anything picklable (a dict of metrics, typically).
        timeout: seconds to reach the job's rendezvous.

    Raises:
        NotInitializedError: this process has not called ``hora.init()``.
    """
    import hora
    if hora.rank() != 0:
        return
    client = _report_client(timeout)
    client.put(f"{REPORT_PREFIX}{_next_report()}", pickle.dumps(value))


_reports = {"client": None, "count": 0, "job": None}


def _report_client(timeout):
    job = (os.environ.get("HORA_JOB_ID"), os.environ.get("HORA_RENDEZVOUS_PORT"))
    if _reports["job"] != job:          # a new job in this actor: start counting again
        if _reports["client"] is not None:
            _reports["client"].close()
        _reports.update(job=job, count=0, client=RendezvousClient(
            os.environ["HORA_RENDEZVOUS_ADDR"], int(os.environ["HORA_RENDEZVOUS_PORT"]),
            os.environ["HORA_SECRET"], timeout=timeout))
    return _reports["client"]


def _next_report():
    n = _reports["count"]
    _reports["count"] = n + 1
    wid = os.environ.get("HORA_ELASTIC_ID")
    if wid is not None:
        # an elastic job (ElasticRayExecutor): rank 0 may be another actor after a round,
        # which counts from 0 too; the time orders the keys of different actors
        return f"{time.time_ns():020d}.{wid}.{n:09d}"
    return f"{n:09d}"


@dataclasses.dataclass
class _Worker:
    """What the driver knows of one rank's actor."""
    actor: object
    node_id: str
    host: str
    pid: int
    gpu_ids: list
    rank: int = None

    def describe(self):
        return f"rank {self.rank} (Ray actor {self.actor._actor_id.hex()[:12]}, pid {self.pid}, " \
               f"host {self.host})"


class RayExecutor:
    """A fixed-size hora job on Ray actors, with Horovod's ``RayExecutor`` API.

    Give ``num_workers`` (the workers are packed onto as few nodes as Ray can), or
    ``num_hosts`` and ``num_workers_per_host`` (exactly that many on each of that many
    nodes).  Inside a placement group (a Ray Tune trial's), the workers use its bundles
    unless ``use_current_placement_group=False``.

    Example:
        >>> def work(x):
        ...     import hora
        ...     hora.init()
        ...     return hora.allreduce(x * (hora.rank() + 1), op=hora.Sum)
        >>> executor = RayExecutor(RayExecutor.create_settings(timeout_s=30),
        ...                        num_workers=2)                   # doctest: +SKIP
        >>> executor.start()                                        # doctest: +SKIP
        >>> executor.run(work, args=[np.ones(3)])                   # doctest: +SKIP
        [array([3., 3., 3.]), array([3., 3., 3.])]
        >>> executor.shutdown()                                     # doctest: +SKIP

    Args:
        settings: a :class:`RaySettings` (:meth:`create_settings`).
        num_workers: number of workers (exclusive with ``num_hosts``).
        num_hosts: number of nodes, each running ``num_workers_per_host`` workers.
        num_workers_per_host: workers per node, with ``num_hosts``.
        cpus_per_worker: CPUs Ray reserves for each worker.
        use_gpu: reserve ``gpus_per_worker`` GPUs (default 1) for each worker; the workers of
            a node then all see the node's reserved GPUs (``CUDA_VISIBLE_DEVICES``), so that
            ``hora.local_rank()`` picks the device.
        gpus_per_worker: GPUs per worker, with ``use_gpu``.
        use_current_placement_group: place the workers in the placement group this process
            runs in, if any.
        min_workers, max_workers, reset_limit, cooldown_range, elastic_timeout,
            override_discovery: Horovod's elastic arguments; not supported (raise): use
            :class:`~hora.integrations.ray_elastic.ElasticRayExecutor`.

    Raises:
        ValueError: neither or both of ``num_workers`` and ``num_hosts``, or a count that is
            not a positive integer.
        NotImplementedError: an elastic argument.
    """

    @classmethod
    def create_settings(cls, timeout_s=30, ssh_identity_file=None, ssh_str=None,
                        placement_group_timeout_s=100, nics=None, grace_s=5.0):
        """The settings of an executor (Horovod's signature).

        Args:
            timeout_s: seconds for the actors to start and the ranks to meet at init().
            ssh_identity_file, ssh_str: accepted for Horovod's callers; not used (Ray starts
                the workers).
            placement_group_timeout_s: seconds for Ray to reserve the resources.
            nics: network interfaces the data plane may use (a set of names), or None.
            grace_s: seconds the other workers get to end after one fails.
        """
        return RaySettings(timeout_s=float(timeout_s),
                           placement_group_timeout_s=float(placement_group_timeout_s),
                           nics=frozenset(nics) if nics else None, grace_s=float(grace_s),
                           ssh_identity_file=ssh_identity_file)

    def __init__(self, settings, num_workers=None, num_hosts=None, num_workers_per_host=1,
                 cpus_per_worker=1, use_gpu=False, gpus_per_worker=None,
                 use_current_placement_group=True, min_workers=None, max_workers=None,
                 reset_limit=None, cooldown_range=None, elastic_timeout=None,
                 override_discovery=None):
        elastic = {k: v for k, v in (("min_workers", min_workers), ("max_workers", max_workers),
                                     ("reset_limit", reset_limit),
                                     ("cooldown_range", cooldown_range),
                                     ("elastic_timeout", elastic_timeout),
                                     ("override_discovery", override_discovery))
                   if v is not None}
        if elastic:
            name, value = next(iter(elastic.items()))
            raise NotImplementedError(f"RayExecutor({name}={value!r}): RayExecutor runs fixed "
                                      f"jobs (give num_workers or num_hosts); for an elastic "
                                      f"job use hora.ray.ElasticRayExecutor")
        if (num_workers is None) == (num_hosts is None):
            raise ValueError(f"RayExecutor: give num_workers or num_hosts (got num_workers="
                             f"{num_workers!r}, num_hosts={num_hosts!r})")
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                            ("num_workers_per_host", num_workers_per_host)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"RayExecutor: {name} must be a positive integer, "
                                 f"got {value!r}")
        if cpus_per_worker < 0 or (gpus_per_worker is not None and gpus_per_worker < 0):
            raise ValueError(f"RayExecutor: negative resources (cpus_per_worker="
                             f"{cpus_per_worker!r}, gpus_per_worker={gpus_per_worker!r})")
        self.settings = settings if settings is not None else RaySettings()
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.num_workers = num_workers if num_workers is not None else \
            num_hosts * num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self.workers = []                  # _Worker, by rank
        self._pg = None
        self._own_pg = False
        self._server = None
        self._lost = None                  # why the job cannot run again, once it cannot
        self._driver_node = None

    def _setting(self, name):
        return getattr(self.settings, name, getattr(RaySettings, name))

    # -- start -------------------------------------------------------------------------------
    def start(self, executable_cls=None, executable_args=None, executable_kwargs=None,
              extra_env_vars=None):
        """Reserve the resources, start the workers and give them the job's environment.

        Args:
            executable_cls: a class each worker instantiates; :meth:`execute` passes the
                instance to its function.
            executable_args, executable_kwargs: its constructor's arguments.
            extra_env_vars: more environment variables for the workers.

        Raises:
            TimeoutError: Ray did not reserve the resources within
                ``placement_group_timeout_s``; or (CollectiveTimeoutError, a TimeoutError)
                the actors did not start within ``timeout_s``.
            WorkerFailedError: an actor died while starting, or the executable's
                constructor raised.
        """
        import ray
        if self.workers:
            raise HoraError("RayExecutor.start(): already started; call shutdown() first")
        if ray.util.client.ray.is_connected():
            raise NotImplementedError("RayExecutor does not run over Ray Client (ray://); "
                                      "run the driver on a node of the cluster")
        self._lost = None
        try:
            self._start_actors(ray)
            self._write_env(ray, dict(extra_env_vars or {}))
            refs = [w.actor.start_executable.remote(executable_cls, executable_args,
                                                    executable_kwargs) for w in self.workers]
            self._gather(refs, timeout_s=self._setting("timeout_s"), what="start_executable")
        except BaseException:
            self.shutdown()
            raise

    def _start_actors(self, ray):
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        bundle_of = self._reserve(ray, get_current_placement_group())
        cls = ray.remote(BaseHoraWorker)
        actors = []
        for i in range(self.num_workers):
            strategy = PlacementGroupSchedulingStrategy(
                self._pg, placement_group_bundle_index=bundle_of(i),
                placement_group_capture_child_tasks=False)
            actors.append(cls.options(num_cpus=self.cpus_per_worker,
                                      num_gpus=self.gpus_per_worker, max_restarts=0,
                                      scheduling_strategy=strategy).remote())
        self.workers = [_Worker(a, None, None, None, None, rank=i) for i, a in enumerate(actors)]
        info = self._gather([a.placement.remote() for a in actors],
                            timeout_s=self._setting("timeout_s"), what="start")
        for worker, (node_id, host, pid, gpus) in zip(self.workers, info):
            worker.node_id, worker.host, worker.pid, worker.gpu_ids = node_id, host, pid, gpus
        # ranks host by host, in the order the hosts first appear
        nodes = list(dict.fromkeys(w.node_id for w in self.workers))
        self.workers.sort(key=lambda w: nodes.index(w.node_id))
        names = _host_names(self.workers)
        for rank, worker in enumerate(self.workers):
            worker.rank, worker.host = rank, names[worker.node_id]

    def _reserve(self, ray, current):
        """Get the placement group; return ``worker index -> bundle index``."""
        units = self.num_hosts or self.num_workers
        per_unit = self.num_workers_per_host if self.num_hosts else 1
        if self.use_current_placement_group and current is not None:
            self._pg, self._own_pg = current, False
            # a Ray Tune trial's group: a head bundle (maybe empty, then left out) for the
            # trial itself, then the workers' bundles
            offset = {units: 0, units + 1: 1}.get(current.bundle_count)
            log.debug("workers in the current placement group (%d bundles)",
                      current.bundle_count)
            if offset is None:
                return lambda i: -1
            return lambda i: offset + i // per_unit
        bundle = {"CPU": self.cpus_per_worker * per_unit}
        if self.gpus_per_worker:
            bundle["GPU"] = self.gpus_per_worker * per_unit
        strategy = "STRICT_SPREAD" if self.num_hosts else "PACK"
        self._pg = ray.util.placement_group([dict(bundle) for _ in range(units)],
                                            strategy=strategy)
        self._own_pg = True
        ready, _ = ray.wait([self._pg.ready()],
                            timeout=self._setting("placement_group_timeout_s"))
        if not ready:
            raise TimeoutError(
                f"Ray did not reserve {units} x {bundle} ({strategy}) within "
                f"{self._setting('placement_group_timeout_s'):g} s "
                f"(placement_group_timeout_s); available: {ray.available_resources()}")
        return lambda i: i // per_unit

    def _write_env(self, ray, extra):
        nics = self._setting("nics")
        base = job_env({}, extra, sorted(nics)[0] if nics else None,
                       self._setting("timeout_s"))
        self._driver_node = driver_node = ray.get_runtime_context().get_node_id()
        if all(w.node_id == driver_node for w in self.workers):
            bind = addr = "127.0.0.1"
        else:               # the address Ray knows this node by, reachable from the others
            bind = "0.0.0.0"
            addr = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}[driver_node]
        secret = new_secret()
        self._server = RendezvousServer(secret, host=bind, port=0).start()
        slots = assign_slots(_host_specs(self.workers), len(self.workers))
        gpus = {}
        for w in self.workers:
            gpus.setdefault(w.node_id, []).extend(w.gpu_ids)
        job_id = uuid.uuid4().hex[:12]
        refs = []
        for worker, slot in zip(self.workers, slots):
            env = worker_env(slot, base, addr, self._server.port, secret, job_id)
            if gpus[worker.node_id]:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[worker.node_id])
            refs.append(worker.actor.update_env_vars.remote(env))
        self._gather(refs, timeout_s=self._setting("timeout_s"), what="set-up")
        log.debug("hora job %s: %s; rendezvous at %s:%d", job_id,
                  ", ".join(f"rank {w.rank} on {w.host}" for w in self.workers), addr,
                  self._server.port)

    # -- run ---------------------------------------------------------------------------------
    def execute(self, fn, callbacks=None, timeout_s=None):
        """``fn(executable)`` on every worker; return the results by rank.

        Args:
            fn: a function of the worker's executable object (None without
                ``executable_cls``).
            callbacks: functions called with each value rank 0 passes to :func:`report`.
            timeout_s: seconds to wait (None: no limit; failures end the wait regardless).

        Raises:
            WorkerFailedError: a worker raised or its actor died (the first such rank).
            CollectiveTimeoutError: ``timeout_s`` passed (the workers were killed).
        """
        return self._execute(fn, callbacks, timeout_s, "execute")

    def _execute(self, fn, callbacks, timeout_s, what):
        # reports of earlier calls in this job were handed out then; count them before the
        # workers start, or this call's first reports could be taken for old ones
        reported = len(self._server.items(REPORT_PREFIX)) if self._server is not None else 0
        return self._gather(self._run_remote(fn), timeout_s=timeout_s, what=what,
                            callbacks=callbacks, reported=reported)

    def run(self, fn, args=None, kwargs=None, callbacks=None, timeout_s=None):
        """``fn(*args, **kwargs)`` on every worker; return the results by rank.

        Raises as :meth:`execute`.
        """
        return self._execute(functools.partial(_call, fn, tuple(args or ()), dict(kwargs or {})),
                             callbacks, timeout_s, "run")

    def run_remote(self, fn, args=None, kwargs=None):
        """Start ``fn(*args, **kwargs)`` on every worker; return their Ray object refs, by
        rank (``ray.get`` raises Ray's own errors for them)."""
        return self._run_remote(functools.partial(_call, fn, tuple(args or ()),
                                                  dict(kwargs or {})))

    def execute_single(self, fn):
        """``fn(executable)`` on rank 0 only; return its result."""
        return self._gather([self._run_remote(fn, ranks=1)[0]], timeout_s=None,
                            what="execute_single")[0]

    def _run_remote(self, fn, ranks=None):
        if not self.workers:
            raise HoraError("RayExecutor: not started; call start() first")
        if self._lost is not None:
            raise HoraError(f"RayExecutor: the job lost workers ({self._lost}); call shutdown() "
                            f"and start() again")
        return [w.actor.execute.remote(fn) for w in self.workers[:ranks]]

    def _gather(self, refs, timeout_s, what, callbacks=None, reported=0):
        """Every ref's value, by rank; on the first failure, the other workers get
        ``grace_s`` to end, then are killed, and the earliest failure is raised.  Rank 0's
        reports after the first ``reported`` go to ``callbacks``."""
        import ray
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = dict(zip(refs, self.workers))
        values, failures, grace_until = {}, [], None
        while pending:
            now = time.monotonic()
            if grace_until is not None and now >= grace_until:
                break
            if deadline is not None and now >= deadline:
                self._kill(list(pending.values()), f"still running after {timeout_s:g} s")
                raise CollectiveTimeoutError(
                    f"RayExecutor.{what}: not done within {timeout_s:g} s; "
                    f"{', '.join(w.describe() for w in pending.values())} still running "
                    f"(killed)")
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=_POLL_S)
            for ref in ready:
                worker = pending.pop(ref)
                try:
                    values[worker.rank] = ray.get(ref, timeout=0)
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                    failures.append((worker, e))
                    if grace_until is None:
                        grace_until = time.monotonic() + self._setting("grace_s")
            reported = self._deliver(callbacks, reported)
        if pending:
            self._kill(list(pending.values()),
                       f"still running {self._setting('grace_s'):g} s after a worker failed")
        reported = self._deliver(callbacks, reported)
        if failures:
            dead = [w.describe() for w, e in failures
                    if isinstance(e, ray.exceptions.RayActorError)]
            if dead:
                self._lost = f"{', '.join(dead)} died"
            raise _failure_error(what, failures)
        return [values[w.rank] for w in self.workers[:len(refs)]]

    def _deliver(self, callbacks, done):
        """Hand the values rank 0 reported since the ``done`` first to ``callbacks``."""
        if not callbacks or self._server is None:
            return done
        new = sorted(self._server.items(REPORT_PREFIX).items())[done:]
        for _, blob in new:
            value = pickle.loads(blob)      # from an authenticated worker of this job
            for callback in callbacks:
                callback(value)
        return done + len(new)

    def _kill(self, workers, why):
        import ray
        for w in workers:
            log.warning("killing %s: %s", w.describe(), why)
            ray.kill(w.actor, no_restart=True)
        if workers:
            self._lost = f"{', '.join(w.describe() for w in workers)} killed: {why}"

    # -- shutdown ----------------------------------------------------------------------------
    def shutdown(self):
        """Stop the workers (hora first, then the actors), release the placement group and
        the rendezvous.  Safe to call twice."""
        import ray
        workers, self.workers = self.workers, []
        if workers and self._lost is None:
            refs = [w.actor.shutdown_hora.remote() for w in workers]
            ray.wait(refs, num_returns=len(refs), timeout=self._setting("shutdown_timeout_s"))
        for w in workers:
            ray.kill(w.actor, no_restart=True)
        if self._pg is not None and self._own_pg:
            ray.util.remove_placement_group(self._pg)
        self._pg = None
        if self._server is not None:
            self._server.stop()
            self._server = None
        # shared-memory segments of killed workers on this node (a worker killed mid-job)
        for path in remove_segments_of([w.pid for w in workers
                                        if w.pid is not None and w.node_id == self._driver_node]):
            log.debug("removed %s, left behind by a worker", path)


def _host_names(workers):
    """``{node id: name}``: the host name, made unique where two Ray nodes share one (a
    cluster of nodes on one machine)."""
    by_host = {}
    for w in workers:
        by_host.setdefault(w.host, []).append(w.node_id)
    names = {}
    for host, node_ids in by_host.items():
        node_ids = list(dict.fromkeys(node_ids))
        for node_id in node_ids:
            names[node_id] = host if len(node_ids) == 1 else f"{host}-{node_id[:8]}"
    return names


def _host_specs(workers):
    """One HostSpec per node, in rank order, with as many slots as it has workers."""
    counts = {}
    for w in workers:
        counts[w.host] = counts.get(w.host, 0) + 1
    return [HostSpec(host, n) for host, n in counts.items()]


def _failure_error(what, failures):
    """The WorkerFailedError for ``failures`` (``[(worker, ray error)]`` in the order they
    were seen): a dead actor before a raised error (a peer's death makes the others raise),
    then the first seen."""
    import ray
    deaths = [f for f in failures if isinstance(f[1], ray.exceptions.RayActorError)]
    worker, error = (deaths or failures)[0]
    if isinstance(error, ray.exceptions.RayActorError):
        detail = f"its Ray actor died: {str(error).strip().splitlines()[0]}"
        message = f"RayExecutor.{what}: {worker.describe()}: {detail}"
    else:
        detail = str(error)
        message = f"RayExecutor.{what}: {worker.describe()} raised:\n{detail}"
    others = [w.rank for w, _ in failures if w is not worker]
    if others:
        message += f"\n(ranks {others} failed after it)"
    err = WorkerFailedError(message, rank=worker.rank, host=worker.host, detail=detail)
    err.__cause__ = error
    return err
