"""Settings: the only reader of ``HORA_*`` / ``HOROVOD_*`` environment variables.

Every setting is declared once in :data:`DECLARED` with its type, the values it accepts, its
default and a doc line, and every read checks the value: a bad one raises
:class:`~hora.errors.SettingError` naming the variable, the value and what is accepted.
``HORA_<NAME>`` wins over ``HOROVOD_<NAME>``, which is accepted so that existing Horovod job
configurations keep working (with Horovod's meanings: ``HOROVOD_FUSION_THRESHOLD=0`` turns
fusion off, ``HOROVOD_CACHE_CAPACITY=0`` the response cache).

Also the other names the launcher and its workers must agree on without either importing
the other's layer: the data planes a ``HORA_BACKEND`` may name (:data:`BACKENDS`) and the
names of shared-memory segments (:data:`SEGMENT_PREFIX`, :func:`remove_segments_of`).

Lowest layer: imports only ``hora.errors``.
"""
import dataclasses
import logging
import math
import os

from .errors import SettingError

__all__ = ["Settings", "settings_from_env", "env_value", "check_settings", "DECLARED",
           "LOG_LEVELS", "log_level_number", "BACKENDS", "SEGMENT_DIR", "SEGMENT_PREFIX",
           "remove_segments_of", "MAX_SECONDS", "timeline_file", "check_writable_file"]

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


# The longest duration a setting may ask for: the waits that take it end up in epoll, whose
# timeout is a 32-bit count of milliseconds (about 24.8 days; beyond it Python raises
# OverflowError); 1e6 s (11.6 days) leaves room for the sums made of it.
MAX_SECONDS = 1e6

# The smallest shared-memory slot: a page (hora.backends.shm rounds slots down to pages).
_PAGE = 4096

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class _Var:
    """One setting.  A number must be finite and lie in ``[low, high]`` (``low`` excluded
    when ``low_open``); ``or_zero`` also accepts 0 (an "off" or "automatic" below ``low``)."""
    name: str
    kind: type
    default: object
    doc: str
    aliases: tuple = ()
    choices: tuple = ()         # the values accepted (case-insensitive; stored as spelled here)
    low: float = None
    high: float = None
    low_open: bool = False
    or_zero: bool = False
    unit: str = ""              # what a number counts ("seconds", "bytes", ...)
    placement: bool = False     # written by the launcher for each worker, not set by users

    def allowed(self):
        """What the setting accepts, in words."""
        if self.kind is bool:
            return "1 or 0 (or true/false, yes/no, on/off)"
        if self.choices:
            return f"one of {', '.join(self.choices)}"
        if self.kind is str:
            return "text"
        what = "a whole number" if self.kind is int else "a number"
        if self.unit:
            what += f" of {self.unit}"
        bounds = []
        if self.low is not None:
            bounds.append(f"{'>' if self.low_open else '>='} {_number(self.low)}")
        if self.high is not None:
            bounds.append(f"<= {_number(self.high)}")
        text = f"{what} {' and '.join(bounds)}".rstrip()
        return f"0 or {text}" if self.or_zero else text

    def accepts(self, value):
        """Whether ``value`` (of ``kind``) is in range."""
        if self.kind not in (int, float):
            return True
        if self.or_zero and value == 0:
            return True
        if not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or self.low_open and value == self.low):
            return False
        return self.high is None or value <= self.high


def _number(x):
    return str(int(x)) if x == int(x) and abs(x) < 1e7 else f"{x:g}"


def _seconds(name, default, doc, **range_):
    """A duration in seconds: finite, at most :data:`MAX_SECONDS`, above 0 unless ``range_``
    says otherwise."""
    return _Var(name, float, default, doc, **{"low": 0, "low_open": True, "unit": "seconds",
                                               "high": MAX_SECONDS, **range_})


# name (without prefix), type, default, doc
DECLARED = {v.name: v for v in [
    # placement: written by `hora run` (and by Horovod's gloo launcher under HOROVOD_*)
    _Var("RANK", int, None, "global rank of this process", low=0, placement=True),
    _Var("SIZE", int, None, "number of processes in the job", low=1, placement=True),
    _Var("LOCAL_RANK", int, None, "rank among the processes on this host", low=0,
         placement=True),
    _Var("LOCAL_SIZE", int, None, "number of processes on this host", low=1,
         placement=True),
    _Var("CROSS_RANK", int, None, "index of this host among hosts with this local rank",
         low=0, placement=True),
    _Var("CROSS_SIZE", int, None, "number of hosts with this local rank", low=1,
         placement=True),
    _Var("HOSTNAME", str, None, "the host name the launcher assigned this process to",
         placement=True),
    _Var("RENDEZVOUS_ADDR", str, None, "address of the job's rendezvous server",
         aliases=("GLOO_RENDEZVOUS_ADDR",), placement=True),
    _Var("RENDEZVOUS_PORT", int, None, "port of the job's rendezvous server",
         aliases=("GLOO_RENDEZVOUS_PORT",), low=1, high=65535, placement=True),
    _Var("SECRET", str, None, "the job secret every control connection proves it knows "
         "(hora run sets a fresh random one per job; under torchrun, Slurm or SageMaker set "
         "the same text on every rank for a real secret)", placement=True),
    _Var("SECRET_FILE", str, None, "a file holding the job secret, read when HORA_SECRET is "
         "unset; it must be yours and of mode 0600 (refused when others may read it)"),
    _Var("JOB_ID", str, None, "identifier of the job (launcher-made)", placement=True),
    _Var("IFACE", str, None, "network interface (or address) the data plane binds to",
         aliases=("GLOO_IFACE",)),
    _Var("ELASTIC", bool, False, "this worker belongs to an elastic job (hora run "
         "--min-np/--max-np/--host-discovery-script): init() joins the job the launcher "
         "forms next, and elastic.run re-forms it when workers come and go",
         placement=True),
    _Var("ELASTIC_ID", str, None, "an elastic worker's name in its launcher's rounds "
         "(launcher-made)", placement=True),
    _seconds("ELASTIC_TIMEOUT", 600.0, "elastic jobs: seconds a worker waits to be "
             "placed in a job, and the launcher waits for enough workers (--min-np)"),
    _seconds("DISCOVERY_TIMEOUT", 10.0, "elastic jobs: seconds one run of the host "
             "discovery script may take before it is killed (Horovod waits without bound)"),
    _Var("SAGEMAKER_ROOT", str, None, "SageMaker's base directory (default /opt/ml): "
         "where resourceconfig.json, hyperparameters.json and the channels are"),
    # behaviour
    _Var("BACKEND", str, "auto", "data-plane backend: auto (shared memory when every rank is "
         "on one host, else TCP), shm, hierarchical, tcp, gloo (torch.distributed), mpi "
         "(mpi4py, under mpirun) or nccl (CUDA tensors through NCCL, host buffers as auto)",
         choices=BACKENDS),
    # every rank reduces its part of a slot between two barriers: a slot small enough to stay
    # in the CPU caches while it is reduced, large enough that the barriers cost little next
    # to the copying; a few MiB meets both on common CPUs
    _Var("SHM_SLOT_BYTES", int, 4 * _MiB, "bytes each rank puts in shared memory at a time",
         low=_PAGE, unit="bytes"),
    _Var("SHM_CMA", bool, True, "large reduce-scatters and gathers in shared memory read "
         "the other ranks' buffers directly (process_vm_readv: one copy instead of two) where "
         "the kernel lets the ranks read each other (0: always through the segment)"),
    _Var("HIERARCHICAL_PIECE_BYTES", int, 0, "the hierarchical plane (across hosts) moves a "
         "large buffer in pieces of this many bytes per rank of the job (0: measure the best "
         "of a few sizes on the job's first large allreduces)", low=_PAGE, or_zero=True,
         unit="bytes"),
    _Var("SHM_BOARD", bool, True, "blocking allreduces of at most 4 MiB (less from 5 ranks "
         "on, 1 MiB where /dev/shm is small; across hosts: below 64 KiB) and blocking "
         "barriers agree and reduce through shared memory in each host instead of the engine "
         "(0: never)"),
    _Var("SPIN_TIME_US", float, 250.0, "microseconds a thread waiting for a collective "
         "polls without sleeping, counted again from each request it sends (0: never); "
         "where more ranks than CPUs share the CPUs, it yields its CPU between two polls",
         low=0, high=MAX_SECONDS * 1e6, unit="microseconds"),
    _seconds("START_TIMEOUT", 30.0, "seconds for every rank to arrive at init()"),
    _Var("RANK_ASLR", str, "AUTO", "hora run: whether the ranks it starts get address-space "
         "randomization: AUTO (not on a machine that runs more of the job's ranks than it "
         "has CPUs, where ranks taking turns on a CPU then share the branch predictor's "
         "training of the interpreter's code), ON (always, the system's default) or OFF "
         "(never)", choices=("AUTO", "ON", "OFF")),
    _Var("SSH_SESSIONS", int, 8, "hora run: ranks (and start-up checks) that share one ssh "
         "connection to a host, one key exchange and login for all (OpenSSH's ControlMaster; "
         "keep it under the hosts' sshd MaxSessions, 10 by default); 0: one connection a rank",
         low=0),
    _seconds("TRANSPORT_TIMEOUT", 300.0,
             "seconds a transfer may make no progress while its peers are alive, and that "
             "shutdown() waits for the other ranks to call it too"),
    # 0, not Horovod's 1 ms: hora's engine wakes as soon as a request is queued, so a cycle
    # is only a delay unless holding a burst back (gradients arriving during backward)
    # saves more in fewer, larger collectives than the wait costs (HORA_AUTOTUNE tries some)
    _Var("CYCLE_TIME", float, 0.0,
         "milliseconds a burst of requests is held to travel together (0: send at once)",
         low=0, high=MAX_SECONDS * 1e3, unit="milliseconds"),
    _Var("FUSION_THRESHOLD", int, 128 * _MiB, "bytes of allreduce tensors fused into one "
         "buffer (0: no fusion)", low=0, unit="bytes"),
    _Var("CACHE_CAPACITY", int, 1024, "response cache entries (0 disables)", low=0),
    # rank 0 reads a message from each rank of its host and each leader below it about each
    # time a host's ranks send some requests; 16 keeps that near what it is at 8 hosts
    _Var("CONTROL_FANOUT", int, 16, "host leaders whose control connections go to one rank: "
         "rank 0 has this many below it, and in a job of more hosts so does each leader, a "
         "tree (same value on every rank; jobs of more hosts also settle small allreduces "
         "through the engine instead of their hosts' boards)", low=1),
    _Var("AUTOTUNE", bool, False, "tune the fusion threshold and cycle time online"),
    _Var("AUTOTUNE_LOG", str, None, "CSV file where rank 0 logs every autotune trial"),
    _Var("AUTOTUNE_WARMUP_SAMPLES", int, 3, "autotune samples discarded at the start", low=0),
    _Var("AUTOTUNE_STEPS_PER_SAMPLE", int, 10, "allreduce batches in one autotune sample",
         low=1),
    _Var("BUCKET_CAP_MB", float, 25.0,
         "DistributedOptimizer without groups: MB of gradients per collective (0: one per "
         "tensor, as Horovod)", low=0, unit="MB"),
    # unset: 1 MB (DDP's first bucket: the last layers' gradients, ready first, start their
    # allreduce early in backward) when a CPU is free for it, else a whole bucket, since a
    # reduction beside a backward that uses every CPU slows it (hora.torch.buckets.spare_cpu)
    _Var("FIRST_BUCKET_CAP_MB", float, None,
         "DistributedOptimizer without groups: MB of the first bucket (the gradients "
         "backward produces first); unset: 1 when a CPU is free for communication during "
         "backward, else HORA_BUCKET_CAP_MB", low=0, unit="MB"),
    _Var("STALL_CHECK_DISABLE", bool, False, "turn the stall inspector off"),
    _seconds("STALL_CHECK_TIME_SECONDS", 60.0, "seconds before a stall warning"),
    _seconds("STALL_SHUTDOWN_TIME_SECONDS", 0.0, "seconds of stall before failing (0: never)",
             low_open=False),
    _Var("LOG_LEVEL", str, "WARNING", "log level of hora's loggers: " + ", ".join(LOG_LEVELS),
         choices=LOG_LEVELS),
    _Var("TIMELINE", str, None, "file where rank 0 writes a Chrome-trace timeline of every "
         "rank's collectives (hora.core.timeline)"),
    _Var("MONITOR", bool, False, "put this rank's status in the launcher's store twice a "
         "second (set by hora run --monitor)"),
    _Var("METRICS_DIR", str, None, "rank 0 writes every rank's engine metrics here as "
         "TensorBoard scalars (hora.core.stats)"),
    _seconds("METRICS_PERIOD", 5.0, "seconds between two writes of the metrics"),
    _Var("TIMELINE_MARK_CYCLES", bool, False, "the timeline marks each engine cycle that "
         "sent requests"),
    _Var("TIMELINE_MAX_EVENTS", int, 200000, "timeline events waiting to be written beyond "
         "which new ones are dropped (and counted)", low=1),
]}


def _parse(var, raw, key):
    """``raw``, the value of environment variable ``key``, as setting ``var``'s type.

    Raises:
        SettingError: ``raw`` is not of the type, or out of the range, ``var`` accepts.
    """
    text = raw.strip()
    if var.kind is bool:
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        if text.isdigit():                 # Horovod's reading: a number, true when above 0
            return int(text) > 0
    elif var.choices:
        for choice in var.choices:
            if text.upper() == choice.upper():
                return choice
    elif var.kind is str:
        return raw
    else:
        try:
            value = var.kind(text)
        except ValueError:
            value = None
        if value is not None and var.accepts(value):
            return value
    raise SettingError(key, raw, var.allowed())


def _keys(var):
    """The variables that may set ``var``, the first set one winning."""
    return (f"HORA_{var.name}", f"HOROVOD_{var.name}",
            *(f"HOROVOD_{a}" for a in var.aliases), *(f"HORA_{a}" for a in var.aliases))


def env_value(name, env=None):
    """The value of setting ``name`` from ``env`` (default ``os.environ``), or its default.

    Raises:
        SettingError: the variable is set to something its setting does not accept (a
            ``ValueError`` naming the variable, its value and what is accepted).
    """
    env = os.environ if env is None else env
    var = DECLARED[name]
    for key in _keys(var):
        raw = env.get(key)
        if raw is not None and raw != "":
            return _parse(var, raw, key)
    return var.default


def check_settings(env=None, placement=False):
    """Check every setting ``env`` (default ``os.environ``) sets, at once: for a launcher
    before it starts anything, and for ``init()`` before it joins a job.

    Args:
        placement: also check what a launcher writes for each worker (rank, size,
            rendezvous, ...); a launcher leaves these out, since it writes them over.

    Raises:
        SettingError: the first variable (in the order of :data:`DECLARED`) set to a value
            its setting does not accept.
    """
    env = os.environ if env is None else env
    for var in DECLARED.values():
        if placement or not var.placement:
            env_value(var.name, env)


def timeline_file(env=None):
    """The file ``HORA_TIMELINE`` names for rank 0's timeline from ``init()``, or None (unset,
    or Horovod's ``DYNAMIC``: started later by ``start_timeline()``)."""
    path = env_value("TIMELINE", env)
    return path if path and path.upper() != "DYNAMIC" else None


def check_writable_file(variable, path):
    """Refuse a file this process could not write: it must be a file, or not exist yet in a
    directory this process may create it in (the directories missing are made when it is
    written).  Nothing is created.

    Raises:
        SettingError: naming ``variable``, ``path`` and the reason.
    """
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise SettingError(variable, path, "a file, not a directory")
    if os.path.exists(full):
        if not os.access(full, os.W_OK):
            raise SettingError(variable, path, "a file this process may write (it may not)")
        return
    folder = os.path.dirname(full)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise SettingError(variable, path, f"a file in a directory ({folder} is not one)")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SettingError(variable, path, f"a file in a directory this process may write "
                                           f"(it may not write {folder})")


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
    control_fanout: int = 16
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
    """Build :class:`Settings` from ``HORA_*``/``HOROVOD_*`` variables, after checking
    every setting they hold (:func:`check_settings`), those read later included.

    Raises:
        SettingError: a variable is set to a value its setting does not accept.
    """
    check_settings(env, placement=True)
    get = lambda name: env_value(name, env)  # noqa: E731
    return Settings(
        backend=get("BACKEND"),
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
        control_fanout=get("CONTROL_FANOUT"),
        stall_check=not get("STALL_CHECK_DISABLE"),
        stall_warning_s=get("STALL_CHECK_TIME_SECONDS"),
        stall_shutdown_s=get("STALL_SHUTDOWN_TIME_SECONDS"),
        autotune=get("AUTOTUNE"),
        autotune_log=get("AUTOTUNE_LOG"),
        autotune_warmup_samples=get("AUTOTUNE_WARMUP_SAMPLES"),
        autotune_steps_per_sample=get("AUTOTUNE_STEPS_PER_SAMPLE"),
        iface=get("IFACE"),
        log_level=get("LOG_LEVEL"),
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
