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

The executor's API and settings are here; the driver's loop is
:mod:`hora.integrations.ray_elastic_driver`, the hosts and their placement
:mod:`hora.integrations.ray_discovery`.

Layer: integrations.  ``ray`` is imported lazily; imports the runner's discovery period and
those two modules.
"""
import dataclasses
import logging
import time
import warnings

from ..errors import ElasticTimeoutError, HoraError
from ..runner.discovery import DISCOVERY_PERIOD_S
from .ray_discovery import PolledDiscovery, RayHostDiscovery
from .ray_elastic_driver import ElasticRun

__all__ = ["ElasticRayExecutor", "ElasticRaySettings", "RayHostDiscovery"]

log = logging.getLogger(__name__)

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
        discovery = PolledDiscovery(self.settings.discovery)
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
        job = ElasticRun(self, self._discovery, worker_fn, list(callbacks or ()), timeout_s)
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
