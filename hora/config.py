"""Settings: the only reader of ``HORA_*`` / ``HOROVOD_*`` environment variables.

Every setting is declared once in ``_DECLARED`` with its type, default and a doc line.
``HORA_<NAME>`` wins over ``HOROVOD_<NAME>``, which is accepted so that existing Horovod job
configurations keep working.

Also the other names the launcher and its workers must agree on without either importing
the other's layer: the data planes a ``HORA_BACKEND`` may name (:data:`BACKENDS`) and the
names of shared-memory segments (:data:`SEGMENT_PREFIX`, :func:`remove_segments_of`).

Lowest layer: imports only ``hora.errors``.
"""
import dataclasses
import logging
import os

__all__ = ["Settings", "settings_from_env", "env_value", "DECLARED", "LOG_LEVELS",
           "log_level_number", "BACKENDS", "SEGMENT_DIR", "SEGMENT_PREFIX",
           "remove_segments_of"]

_MiB = 1024 * 1024

# HORA_BACKEND: the data planes by name (hora.core.dataplane makes them; the launcher offers
# the names as `hora run --backend` without importing the planes)
BACKENDS = ("auto", "tcp", "shm", "hierarchical", "gloo", "mpi", "nccl")

# HORA_LOG_LEVEL / HOROVOD_LOG_LEVEL: Horovod's names (TRACE..FATAL) and Python's spellings of
# the same levels (WARN, CRITICAL); TRACE logs as DEBUG, FATAL as CRITICAL (Python has no
# TRACE, and FATAL is its alias of CRITICAL)
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "WARN", "ERROR", "FATAL", "CRITICAL")


def log_level_number(name):
    """``logging``'s number for one of :data:`LOG_LEVELS` (Python knows WARN and FATAL; it has
    no TRACE, which logs as DEBUG)."""
    return logging.DEBUG if name == "TRACE" else logging.getLevelName(name)


@dataclasses.dataclass(frozen=True)
class _Var:
    name: str
    kind: type
    default: object
    doc: str
    aliases: tuple = ()
    choices: tuple = ()         # the values accepted (case-insensitive; stored upper-case)


# name (without prefix), type, default, doc
DECLARED = {v.name: v for v in [
    # placement: written by `hora run` (and by Horovod's gloo launcher under HOROVOD_*)
    _Var("RANK", int, None, "global rank of this process"),
    _Var("SIZE", int, None, "number of processes in the job"),
    _Var("LOCAL_RANK", int, None, "rank among the processes on this host"),
    _Var("LOCAL_SIZE", int, None, "number of processes on this host"),
    _Var("CROSS_RANK", int, None, "index of this host among hosts with this local rank"),
    _Var("CROSS_SIZE", int, None, "number of hosts with this local rank"),
    _Var("HOSTNAME", str, None, "the host name the launcher assigned this process to"),
    _Var("RENDEZVOUS_ADDR", str, None, "address of the job's rendezvous server",
         aliases=("GLOO_RENDEZVOUS_ADDR",)),
    _Var("RENDEZVOUS_PORT", int, None, "port of the job's rendezvous server",
         aliases=("GLOO_RENDEZVOUS_PORT",)),
    _Var("SECRET", str, None, "the job secret every control connection proves it knows "
         "(hora run sets a fresh random one per job; under torchrun, Slurm or SageMaker set "
         "the same text on every rank for a real secret)"),
    _Var("SECRET_FILE", str, None, "a file holding the job secret, read when HORA_SECRET is "
         "unset; it must be yours and of mode 0600 (refused when others may read it)"),
    _Var("JOB_ID", str, None, "identifier of the job (launcher-made)"),
    _Var("IFACE", str, None, "network interface (or address) the data plane binds to",
         aliases=("GLOO_IFACE",)),
    _Var("ELASTIC", bool, False, "this worker belongs to an elastic job (hora run "
         "--min-np/--max-np/--host-discovery-script): init() joins the job the launcher "
         "forms next, and elastic.run re-forms it when workers come and go"),
    _Var("ELASTIC_ID", str, None, "an elastic worker's name in its launcher's rounds "
         "(launcher-made)"),
    _Var("ELASTIC_TIMEOUT", float, 600.0, "elastic jobs: seconds a worker waits to be "
         "placed in a job, and the launcher waits for enough workers (--min-np)"),
    _Var("SAGEMAKER_ROOT", str, None, "SageMaker's base directory (default /opt/ml): "
         "where resourceconfig.json, hyperparameters.json and the channels are"),
    # behaviour
    _Var("BACKEND", str, "auto", "data-plane backend: auto (shared memory when every rank is "
         "on one host, else TCP), shm, hierarchical, tcp, gloo (torch.distributed), mpi "
         "(mpi4py, under mpirun) or nccl (CUDA tensors through NCCL, host buffers as auto)"),
    # every rank reduces its part of a slot between two barriers: a slot small enough to stay
    # in the CPU caches while it is reduced, large enough that the barriers cost little next
    # to the copying; a few MiB meets both on common CPUs
    _Var("SHM_SLOT_BYTES", int, 4 * _MiB, "bytes each rank puts in shared memory at a time"),
    _Var("SHM_CMA", bool, True, "large reduce-scatters and gathers in shared memory read "
         "the other ranks' buffers directly (process_vm_readv: one copy instead of two) where "
         "the kernel lets the ranks read each other (0: always through the segment)"),
    _Var("HIERARCHICAL_PIECE_BYTES", int, 0, "the hierarchical plane (across hosts) moves a "
         "large buffer in pieces of this many bytes per rank of the job (0: measure the best "
         "of a few sizes on the job's first large allreduces)"),
    _Var("SHM_BOARD", bool, True, "blocking allreduces of at most 1 MiB (across hosts: "
         "below 64 KiB) and blocking barriers agree and reduce through shared memory in each "
         "host instead of the engine (0: never)"),
    _Var("SPIN_TIME_US", float, 250.0, "microseconds a thread waiting for a collective "
         "polls without sleeping, counted again from each request it sends (0: never); "
         "where more ranks than CPUs share the CPUs, it yields its CPU between two polls"),
    _Var("START_TIMEOUT", float, 30.0, "seconds for every rank to arrive at init()"),
    _Var("RANK_ASLR", str, "AUTO", "hora run: whether the ranks it starts get address-space "
         "randomization: AUTO (not on a machine that runs more of the job's ranks than it "
         "has CPUs, where ranks taking turns on a CPU then share the branch predictor's "
         "training of the interpreter's code), ON (always, the system's default) or OFF "
         "(never)", choices=("AUTO", "ON", "OFF")),
    _Var("TRANSPORT_TIMEOUT", float, 300.0,
         "seconds a transfer may make no progress while its peers are alive, and that "
         "shutdown() waits for the other ranks to call it too"),
    # 0, not Horovod's 1 ms: hora's engine wakes as soon as a request is queued, so a cycle
    # is only a delay unless holding a burst back (gradients arriving during backward)
    # saves more in fewer, larger collectives than the wait costs (HORA_AUTOTUNE tries some)
    _Var("CYCLE_TIME", float, 0.0,
         "milliseconds a burst of requests is held to travel together (0: send at once)"),
    _Var("FUSION_THRESHOLD", int, 128 * _MiB, "bytes of allreduce tensors fused into one buffer"),
    _Var("CACHE_CAPACITY", int, 1024, "response cache entries (0 disables)"),
    _Var("AUTOTUNE", bool, False, "tune the fusion threshold and cycle time online"),
    _Var("AUTOTUNE_LOG", str, None, "CSV file where rank 0 logs every autotune trial"),
    _Var("AUTOTUNE_WARMUP_SAMPLES", int, 3, "autotune samples discarded at the start"),
    _Var("AUTOTUNE_STEPS_PER_SAMPLE", int, 10, "allreduce batches in one autotune sample"),
    _Var("BUCKET_CAP_MB", float, 25.0,
         "DistributedOptimizer without groups: MB of gradients per collective (0: one per "
         "tensor, as Horovod)"),
    # unset: 1 MB (DDP's first bucket: the last layers' gradients, ready first, start their
    # allreduce early in backward) when a CPU is free for it, else a whole bucket, since a
    # reduction beside a backward that uses every CPU slows it (hora.torch.optimizer._spare_cpu)
    _Var("FIRST_BUCKET_CAP_MB", float, None,
         "DistributedOptimizer without groups: MB of the first bucket (the gradients "
         "backward produces first); unset: 1 when a CPU is free for communication during "
         "backward, else HORA_BUCKET_CAP_MB"),
    _Var("STALL_CHECK_DISABLE", bool, False, "turn the stall inspector off"),
    _Var("STALL_CHECK_TIME_SECONDS", float, 60.0, "seconds before a stall warning"),
    _Var("STALL_SHUTDOWN_TIME_SECONDS", float, 0.0, "seconds of stall before failing (0: never)"),
    _Var("LOG_LEVEL", str, "WARNING", "log level of hora's loggers: " + ", ".join(LOG_LEVELS),
         choices=LOG_LEVELS),
    _Var("TIMELINE", str, None, "file where rank 0 writes a Chrome-trace timeline of every "
         "rank's collectives (hora.core.timeline)"),
    _Var("MONITOR", bool, False, "put this rank's status in the launcher's store twice a "
         "second (set by hora run --monitor)"),
    _Var("METRICS_DIR", str, None, "rank 0 writes every rank's engine metrics here as "
         "TensorBoard scalars (hora.core.stats)"),
    _Var("METRICS_PERIOD", float, 5.0, "seconds between two writes of the metrics"),
    _Var("TIMELINE_MARK_CYCLES", bool, False, "the timeline marks each engine cycle that "
         "sent requests"),
    _Var("TIMELINE_MAX_EVENTS", int, 200000, "timeline events waiting to be written beyond "
         "which new ones are dropped (and counted)"),
]}


def _parse(var, raw, key):
    """``raw``, the value of environment variable ``key``, as setting ``var``'s type."""
    if var.kind is bool:
        return raw.strip().lower() not in ("", "0", "false", "no", "off")
    if var.choices:
        value = raw.strip().upper()
        if value not in var.choices:
            raise ValueError(f"{key}={raw!r}: expected one of {', '.join(var.choices)}")
        return value
    try:
        return var.kind(raw)
    except ValueError as e:
        raise ValueError(f"{key}={raw!r}: expected {var.kind.__name__}") from e


def env_value(name, env=None):
    """The value of setting ``name`` from ``env`` (default ``os.environ``), or its default.

    Raises:
        ValueError: the variable is set to something its setting does not accept (quoting
            the variable and its value).
    """
    env = os.environ if env is None else env
    var = DECLARED[name]
    for key in (f"HORA_{name}", f"HOROVOD_{name}",
                *(f"HOROVOD_{a}" for a in var.aliases), *(f"HORA_{a}" for a in var.aliases)):
        raw = env.get(key)
        if raw is not None and raw != "":
            return _parse(var, raw, key)
    return var.default


@dataclasses.dataclass(frozen=True)
class Settings:
    """Runtime settings of one process, read once at init()."""
    backend: str = "auto"
    shm_slot_bytes: int = 4 * _MiB
    shm_cma: bool = True
    hierarchical_piece_bytes: int = 0
    shm_board: bool = True
    spin_time_us: float = 250.0
    start_timeout: float = 30.0
    transport_timeout: float = 300.0
    cycle_time_ms: float = 0.0
    fusion_threshold: int = 128 * _MiB
    cache_capacity: int = 1024
    stall_check: bool = True
    stall_warning_s: float = 60.0
    stall_shutdown_s: float = 0.0
    autotune: bool = False
    autotune_log: str = None
    autotune_warmup_samples: int = 3
    autotune_steps_per_sample: int = 10
    iface: str = None
    log_level: str = "WARNING"


def settings_from_env(env=None):
    """Build :class:`Settings` from ``HORA_*``/``HOROVOD_*`` variables."""
    get = lambda name: env_value(name, env)  # noqa: E731
    return Settings(
        backend=get("BACKEND").lower(),
        shm_slot_bytes=get("SHM_SLOT_BYTES"),
        shm_cma=get("SHM_CMA"),
        hierarchical_piece_bytes=get("HIERARCHICAL_PIECE_BYTES"),
        shm_board=get("SHM_BOARD"),
        spin_time_us=get("SPIN_TIME_US"),
        start_timeout=get("START_TIMEOUT"),
        transport_timeout=get("TRANSPORT_TIMEOUT"),
        cycle_time_ms=get("CYCLE_TIME"),
        fusion_threshold=get("FUSION_THRESHOLD"),
        cache_capacity=get("CACHE_CAPACITY"),
        stall_check=not get("STALL_CHECK_DISABLE"),
        stall_warning_s=get("STALL_CHECK_TIME_SECONDS"),
        stall_shutdown_s=get("STALL_SHUTDOWN_TIME_SECONDS"),
        autotune=get("AUTOTUNE"),
        autotune_log=get("AUTOTUNE_LOG"),
        autotune_warmup_samples=get("AUTOTUNE_WARMUP_SAMPLES"),
        autotune_steps_per_sample=get("AUTOTUNE_STEPS_PER_SAMPLE"),
        iface=get("IFACE"),
        log_level=get("LOG_LEVEL").upper(),
    )


# -- shared-memory segment names ------------------------------------------------------------
# A contract between the shared-memory plane (hora.backends.shm), which names each segment
# after the process that creates it, and the launcher, which removes what a killed rank left
# behind.  Here, in the lowest layer, so that the launcher needs neither the planes nor NumPy.
SEGMENT_DIR = "/dev/shm"
SEGMENT_PREFIX = "hora-"


def remove_segments_of(pids, directory=SEGMENT_DIR):
    """Remove the segments that processes ``pids`` created and did not unlink (a rank
    killed during set-up).  Returns the paths removed."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    prefixes = tuple(f"{SEGMENT_PREFIX}{pid}-" for pid in pids)
    for name in names:
        if prefixes and name.startswith(prefixes):
            path = os.path.join(directory, name)
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed
