"""Every exception hora raises.  Lowest layer: imports nothing from hora.

    HoraError
    ├── NotInitializedError            a collective or query before init() (also a ValueError)
    ├── CollectiveError                a collective cannot run as submitted (raised on every rank)
    │   ├── CollectiveMismatchError    ranks disagree about one collective, or it is invalid
    │   └── CollectiveAbortedError     a rank's own arguments failed its checks; it never submitted
    ├── InvalidArgumentError           a call this rank cannot submit (also a ValueError)
    │   └── DuplicateNameError         one rank submitted a name that is still in flight
    ├── HoraInternalError              the job is broken; alias HorovodInternalError
    │   ├── HoraRankFailedError        a peer died or its connection broke (names the rank)
    │   ├── HoraShutdownError          a collective needs a rank that has shut down
    │   └── TransportBrokenError       a connection broke under us (peer died, reset)
    ├── HostsUpdatedInterrupt          elastic: hosts were added or removed (not a failure)
    ├── TransportClosedError           we closed the transport ourselves (shutdown)
    ├── CollectiveTimeoutError         also a TimeoutError
    ├── RendezvousError
    │   ├── RendezvousTimeoutError     also a TimeoutError
    │   ├── RendezvousClosedError
    │   └── AuthenticationError        a peer failed the HMAC handshake
    ├── WorkerFailedError              the launcher's report: earliest failing rank, exit status
    ├── ElasticJobError                an elastic job had to stop (too many resets)
    │   └── ElasticTimeoutError        too few workers for longer than the elastic timeout
    ├── SettingError                   a HORA_*/HOROVOD_* setting has a value it does not accept
    ├── SageMakerConfigError           a SageMaker config file is unreadable or inconsistent
    ├── SharedPipeError                two ranks would read one SageMaker Pipe-mode FIFO
    ├── HostCheckError                 a host failed the launcher's start-up check (names it)
    └── OpenFilesLimitError            the launcher may not open the files its ranks need
                                       (also an OSError, EMFILE)

Every error a collective can raise is a ``RuntimeError`` (``CollectiveError``,
``InvalidArgumentError``, ``HoraInternalError`` and its subclasses, ``CollectiveTimeoutError``),
as Horovod's are, so that Horovod code's ``except RuntimeError`` keeps catching them on every
rank.  Argument checks made before a collective is submitted raise ``TypeError`` or
``ValueError`` on the rank that made the call (as Horovod does); the other ranks get a
``CollectiveAbortedError`` naming that rank and its error.
"""

import errno

__all__ = [
    "HoraError", "NotInitializedError", "CollectiveError", "CollectiveMismatchError",
    "CollectiveAbortedError", "InvalidArgumentError", "DuplicateNameError",
    "HoraInternalError", "HorovodInternalError", "HoraRankFailedError", "HoraShutdownError",
    "TransportBrokenError", "HostsUpdatedInterrupt", "TransportClosedError",
    "CollectiveTimeoutError",
    "RendezvousError", "RendezvousTimeoutError", "RendezvousClosedError", "AuthenticationError",
    "WorkerFailedError", "ElasticJobError", "ElasticTimeoutError", "SettingError",
    "SageMakerConfigError", "SharedPipeError", "HostCheckError", "OpenFilesLimitError",
]


class HoraError(Exception):
    """Base class of every error hora raises on purpose."""


class NotInitializedError(HoraError, ValueError):
    """hora was used before ``hora.init()`` (or after ``hora.shutdown()``)."""

    def __init__(self, what="hora"):
        super().__init__(f"{what} has not been initialized; call hora.init() first.")


class CollectiveError(HoraError, RuntimeError):
    """A collective cannot run as the ranks submitted it; raised on every rank that submitted
    it.  The job stays usable: later collectives run as usual."""


class CollectiveMismatchError(CollectiveError):
    """Ranks submitted the same collective name with different arguments (shape, dtype, op,
    root rank, kind...), or arguments that cannot run together (an alltoall whose rows do not
    split evenly, a broadcast while another rank has joined)."""


class CollectiveAbortedError(CollectiveError):
    """A rank's call of this collective failed its own argument checks, so that rank never
    submitted it; it raised that error itself, and the ranks that did submit get this one.

    Attributes:
        ranks: ``{rank: "ErrorType: message"}`` of the ranks whose calls failed.
    """

    def __init__(self, message, ranks=None):
        super().__init__(message)
        self.ranks = dict(ranks or {})


class InvalidArgumentError(HoraError, ValueError, RuntimeError):
    """This rank's call of a collective cannot be submitted as made (Horovod's
    ``INVALID_ARGUMENT`` status): a process set this rank is not a member of, an alltoall
    whose rows do not divide among the ranks or whose splits are not integers summing to
    the first dimension.  Raised on the calling rank from its own check, before anything is
    submitted; both a ``ValueError`` and a ``RuntimeError``, as Horovod's bindings raise one or
    the other for it (torch and TensorFlow ``ValueError``, MXNet ``RuntimeError``).  The job
    stays usable."""


class DuplicateNameError(InvalidArgumentError):
    """A name was submitted while a collective of the same name was still in flight."""


class HoraInternalError(HoraError, RuntimeError):
    """The job can no longer run collectives: a rank died, left, or a connection broke.

    Elastic training catches this (under Horovod's name ``HorovodInternalError``), restores
    the last committed state and re-forms the job.
    """


HorovodInternalError = HoraInternalError


class HoraRankFailedError(HoraInternalError):
    """A peer process died or became unreachable.  ``rank`` names it."""

    def __init__(self, message, rank=None):
        super().__init__(message)
        self.rank = rank


class HoraShutdownError(HoraInternalError):
    """A collective needs a rank that has already called shutdown()."""


class TransportBrokenError(HoraInternalError):
    """A connection broke from the other side (peer died, reset); not our doing."""

    def __init__(self, message, rank=None):
        super().__init__(message)
        self.rank = rank


class HostsUpdatedInterrupt(HoraError, RuntimeError):
    """Elastic training: hosts joined or left the job; no rank failed (Horovod's name).

    Elastic mode treats it as an interruption, not an error: the state is not restored
    (the last commit is current), the job re-forms and training goes on.

    Attributes:
        skip_sync: True when hosts were only removed, so every surviving rank already
            holds the same state and the broadcast from rank 0 can be skipped.
    """

    def __init__(self, skip_sync=False):
        super().__init__(f"hosts were updated (skip_sync={skip_sync})")
        self.skip_sync = skip_sync


class TransportClosedError(HoraError):
    """The transport was closed by this process (shutdown) while something still used it."""


class CollectiveTimeoutError(HoraError, TimeoutError, RuntimeError):
    """A wait exceeded its deadline."""


class RendezvousError(HoraError):
    """The rendezvous (key-value store shared by launcher and workers) failed."""


class RendezvousTimeoutError(RendezvousError, TimeoutError):
    """A rendezvous wait exceeded its deadline (for example: ranks that never arrived)."""


class RendezvousClosedError(RendezvousError):
    """The rendezvous server went away."""


class AuthenticationError(RendezvousError):
    """A peer did not prove knowledge of the job secret."""


class WorkerFailedError(HoraError):
    """A worker of a launched job failed.  Carries the earliest failure.

    Attributes:
        rank: the global rank of the first worker to fail.
        exitcode: its exit status (negative: killed by that signal), or None.
        host: the host it ran on.
        detail: its traceback or a description of how it ended.
    """

    def __init__(self, message, rank=None, exitcode=None, host=None, detail=None):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.host = host
        self.detail = detail


class ElasticJobError(HoraError, RuntimeError):
    """An elastic job had to stop although no worker's failure ended it: it re-formed more
    often than its reset limit allows.  A ``RuntimeError``, as Horovod's elastic driver
    raises."""


class ElasticTimeoutError(ElasticJobError, TimeoutError):
    """An elastic job had fewer workers than its minimum for longer than its elastic timeout
    (or never had that many).

    Attributes:
        workers: how many workers it had when it stopped.
        min_workers: the minimum it needed.
    """

    def __init__(self, message, workers=None, min_workers=None):
        super().__init__(message)
        self.workers = workers
        self.min_workers = min_workers


class SettingError(HoraError, ValueError):
    """A setting (an environment variable, or the ``hora run`` flag that sets it) has a value
    it does not accept.

    Attributes:
        variable: the variable, e.g. ``"HORA_TRANSPORT_TIMEOUT"``.
        value: its value, as set.
        allowed: what it accepts, in words.
    """

    def __init__(self, variable, value, allowed):
        self.variable, self.value, self.allowed = variable, value, allowed
        super().__init__(f"{variable}={value!r}: expected {allowed}")


class SageMakerConfigError(HoraError, ValueError):
    """A SageMaker configuration file (or ``SM_*`` variable) is unreadable or inconsistent."""


class SharedPipeError(HoraError):
    """More than one rank on a host would read the same SageMaker Pipe-mode FIFO.

    A FIFO delivers each byte to one reader, so two readers split the stream unpredictably
    and one of them usually blocks forever; give every rank its own channel (``train_0``,
    ``train_1``, ...), or run one process per host for that channel.
    """


class HostCheckError(HoraError):
    """A host of a multi-host job failed the launcher's start-up check.

    Raised before any worker starts, within seconds, instead of a long silent start timeout.

    Attributes:
        host: the first host that failed (in host-list order).
        reason: why it failed: unreachable, ssh refused, ssh authentication failed, python or
            hora missing, hora version mismatch, ...
        failures: ``{host: reason}`` for every host that failed.
    """

    def __init__(self, failures):
        self.failures = dict(failures)
        self.host, self.reason = next(iter(self.failures.items()))
        lines = "\n".join(f"  {host}: {reason}" for host, reason in self.failures.items())
        super().__init__(f"{len(self.failures)} host(s) failed the start-up check:\n{lines}")


class OpenFilesLimitError(HoraError, OSError):
    """The launcher may not open as many files as a job of this many ranks needs (its hard
    limit of open files, ``ulimit -Hn``, is too low).

    Raised before any rank starts: the same job would otherwise fail part-way through its
    start, each rank that could not reach the rendezvous reporting a broken connection.

    Attributes:
        needed: the open files the launcher needs for the job.
        limit: the most it may open.
    """

    def __init__(self, needed, limit, ranks):
        self.needed, self.limit = needed, limit
        super().__init__(errno.EMFILE, f"{ranks} ranks need about {needed} open files in the "
                         f"launcher, and it may open {limit} (the hard limit, ulimit -Hn): "
                         f"raise it (ulimit -n {needed}, or nofile in "
                         f"/etc/security/limits.conf), or start fewer ranks from this "
                         f"launcher")
