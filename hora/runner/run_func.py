"""``hora.run(fn, np=...)``: call a Python function on every rank of a job.

The launcher pickles ``(fn, args, kwargs)`` with cloudpickle into the job's rendezvous store;
each worker runs :func:`hora.runner.task.main`, which fetches it, calls it and stores its
return value or traceback.  The parent's ``sys.path`` is passed on through ``PYTHONPATH`` (as
multiprocessing's spawn does) so that functions defined in the caller's modules unpickle in
the workers, and it is the workers' whole path: they start from ``python -c``, whose first
entry (the working directory) they drop, so that a module in the working directory (another
copy of hora, a ``utils.py``) does not shadow the one the caller imported.

Layer: runner.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import cloudpickle

from ..config import env_value
from ..rendezvous.rounds import LATEST_KEY, ROUND_PREFIX
from ..errors import WorkerFailedError
from . import proc
from .elastic import ElasticJob, ElasticSettings
from .launcher import Job
from .launch_config import LaunchConfig
from .remote import SshSettings
from .supervisor import DEFAULT_GRACE_S

__all__ = ["run", "FN_KEY", "RESULT_PREFIX"]

# rendezvous keys shared with the worker side (hora.runner.task, which must not be imported
# here: it is the workers' main module)
FN_KEY = "run/fn"
RESULT_PREFIX = "run/result/"
# a worker's program: ``python -m`` would put the working directory ahead of PYTHONPATH too,
# and keep it there
WORKER_CODE = ("import sys\n"
               "if sys.path and sys.path[0] == '':\n"
               "    del sys.path[0]\n"
               "from hora.runner.task import main\n"
               "sys.exit(main())\n")

DEFAULT_NP = 2

T = TypeVar("T")


def run(fn: Callable[..., T], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
        np: int | None = None, *, num_proc: int | None = None,
        hosts: str | Sequence[Any] | None = None, hostfile: str | os.PathLike | None = None,
        env: Mapping[str, str] | None = None, timeout_s: float | None = None,
        start_timeout: float | None = None, prefix_output: bool = True,
        output_filename: str | os.PathLike | None = None, grace_s: float = DEFAULT_GRACE_S,
        executable: str | None = None, ssh: SshSettings | None = None,
        ssh_port: int | None = None, ssh_identity_file: str | os.PathLike | None = None,
        network_interface: str | Iterable[str] | None = None,
        network_interfaces: str | Iterable[str] | None = None, verbose: bool | int | None = None,
        disable_cache: bool | None = None, use_gloo: bool | None = None,
        use_mpi: bool | None = None, mpi_args: str | None = None,
        min_num_proc: int | None = None, max_num_proc: int | None = None,
        slots: int | None = None, reset_limit: int | None = None,
        cooldown_range: tuple[int, int] | None = None, host_discovery_script: str | None = None,
        elastic_timeout: float | None = None) -> list[T]:
    """Run ``fn(*args, **kwargs)`` on ``np`` worker processes; return their results by rank.

    The function runs in fresh processes, so it calls ``hora.init()`` itself when it needs
    collectives (as with ``horovod.run``).  Workers' output is forwarded to this process's
    stdout/stderr, tagged by rank.  ``horovod.run``'s keyword names are accepted with their
    meaning; a setting given under both names (hora's and Horovod's) must have one value.

    Example:
        >>> def work():
        ...     import hora
        ...     hora.init()
        ...     return hora.rank()
        >>> hora.run(work, np=2)                          # doctest: +SKIP
        [0, 1]
        >>> hora.run(work, num_proc=2, hosts="a:1,b:1", ssh_port=2222)   # doctest: +SKIP
        [0, 1]

    Args:
        fn, args, kwargs: the function (anything cloudpickle can pickle) and its arguments,
            the same on every rank.
        np, num_proc: number of processes (default 2), under hora's name or Horovod's.
        hosts: ``"host1:4,host2:2"`` or a list of HostSpec (default ``localhost:np``).
        hostfile: path of a file of ``host slots=N`` lines (exclusive with ``hosts``).
        env: extra environment variables for the workers.
        timeout_s: overall limit in seconds (None: no limit).
        start_timeout: seconds for a worker to fetch the function and for every rank to
            reach ``hora.init()`` (None: the ``HORA_START_TIMEOUT`` default).
        prefix_output, output_filename, grace_s: as for :func:`hora.runner.launch`.
        executable: the Python interpreter the workers run (default ``sys.executable``).
        ssh, ssh_port, ssh_identity_file: :class:`SshSettings` for remote hosts; the
            other two are Horovod's names for its port and key.
        network_interface, network_interfaces: the interface the data plane binds to on
            every host (``HORA_IFACE``): a name, or the first of ``"eth0,eth1"`` or a list.
        verbose: log the launcher's progress (hosts, ranks started) at DEBUG while the job
            runs, to stderr when this process's logging does not show it otherwise.
        disable_cache, use_gloo, use_mpi, mpi_args: Horovod's launcher options: hora caches
            no host checks, and its own launcher is Horovod's Gloo mode; ``use_mpi`` is
            refused (``hora run --mpi`` runs a script under mpirun), and ``mpi_args``, which
            Horovod uses only with it, is ignored.
        min_num_proc, max_num_proc, host_discovery_script, slots, reset_limit,
            cooldown_range, elastic_timeout: an elastic job (any of the first three makes it
            one), as ``hora run --min-np ...`` (:mod:`hora.runner.elastic`): ``fn`` trains
            under ``hvd.elastic.run``, and the results are its last round's, by rank.

    Returns:
        ``[fn's return value on rank 0, on rank 1, ...]``.

    Raises:
        WorkerFailedError: a worker raised or died: the earliest failure, with its ``rank``,
            ``exitcode``, ``host`` and ``detail`` (its traceback, or how it died).
        CollectiveTimeoutError: ``timeout_s`` passed; lists the ranks that were still running.
        KeyboardInterrupt, SystemExit: the first when this process got SIGINT, the second
            (status 128+signum) for SIGTERM or SIGHUP; the workers were stopped first.
        ValueError: bad or conflicting arguments (``np=2, num_proc=4``; ``ssh`` and
            ``ssh_port`` naming different ports; ``use_gloo`` and ``use_mpi`` both true).
        NotImplementedError: ``use_mpi=True``.
    """
    _check_launcher(use_gloo, use_mpi)
    np = _same("np", np, "num_proc", num_proc)
    np = (min_num_proc or DEFAULT_NP) if np is None else np
    elastic = _elastic(np, hosts or hostfile, min_num_proc, max_num_proc,
                       host_discovery_script, slots, reset_limit, cooldown_range,
                       elastic_timeout)
    nics = _same("network_interface", network_interface,
                 "network_interfaces", network_interfaces)
    ssh = _ssh(ssh, ssh_port, ssh_identity_file)
    blob = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    config = LaunchConfig([executable or sys.executable, "-c", WORKER_CODE], np, hosts=hosts,
                          hostfile=hostfile, env=_worker_env(env), prefix_output=prefix_output,
                          output_filename=output_filename, timeout_s=timeout_s,
                          start_timeout=start_timeout, grace_s=grace_s, store={FN_KEY: blob},
                          ssh=ssh, network_interface=nics)
    with _verbose(verbose):
        result = Job(config).run() if elastic is None else ElasticJob(config, elastic).run()
    return _results(result, np, elastic is not None)


def _check_launcher(use_gloo, use_mpi):
    """Refuse the launcher choices hora cannot honour: both of Horovod's, or MPI (hora's own
    launcher is Horovod's Gloo mode)."""
    if use_gloo and use_mpi:
        raise ValueError("run(use_gloo=True, use_mpi=True): choose one launcher")
    if use_mpi:
        raise NotImplementedError("run(use_mpi=True) is not supported: hora's own launcher "
                                  "starts the workers (leave use_mpi out), or run a script "
                                  "under mpirun with `hora run --mpi`")


def _worker_env(env):
    """The workers' extra environment: ``env``, with this process's path on PYTHONPATH."""
    env = dict(env or {})
    env["PYTHONPATH"] = _pythonpath(env.get("PYTHONPATH"))
    return env


def _results(result, np, elastic):
    """The job's return values in rank order, or the error its end calls for: the signal
    that stopped it, or the earliest worker failure."""
    if result.signal == signal.SIGINT:
        raise KeyboardInterrupt
    if result.signal is not None:
        raise SystemExit(result.exitcode)
    if elastic:
        return _elastic_results(result)
    outcomes = {rank: cloudpickle.loads(result.store[key])
                for rank in range(np)
                if (key := f"{RESULT_PREFIX}{rank}") in result.store}
    if result.failure is not None:
        raise _failure_error(result.failure, outcomes.get(result.failure.rank))
    missing = [e for e in result.exits if e.rank not in outcomes]
    if missing:
        raise _failure_error(missing[0], None)
    return [outcomes[rank][1] for rank in range(np)]


def _elastic(np, fixed_hosts, min_np, max_np, script, slots, reset_limit, cooldown, timeout):
    """The ElasticSettings of hora.run's elastic arguments, or None for a fixed job."""
    if min_np is None and max_np is None and script is None:
        given = [name for name, value in (("slots", slots), ("reset_limit", reset_limit),
                                          ("cooldown_range", cooldown),
                                          ("elastic_timeout", timeout)) if value is not None]
        if given:
            raise ValueError(f"run({given[0]}=...) is for elastic jobs: give min_num_proc, "
                             f"max_num_proc or host_discovery_script too")
        return None
    if max_np is None and script is None:
        max_np = max(np, min_np or np)
    return ElasticSettings(
        min_np=min_np if min_np is not None else np, max_np=max_np, discovery_script=script,
        slots=slots or 1, reset_limit=reset_limit,
        cooldown=tuple(cooldown) if cooldown else None,
        timeout_s=timeout if timeout is not None else env_value("ELASTIC_TIMEOUT"))


def _elastic_results(result):
    """The results of an elastic job's last round, in its rank order (the workers that
    left the job before it ended are not asked)."""
    store = result.store
    latest = store.get(LATEST_KEY)
    members = store.get(f"{ROUND_PREFIX}{latest}", {}).get("members", [])
    outcomes = [(wid, store.get(f"{RESULT_PREFIX}w{wid}")) for wid, _ in members]
    if result.exitcode != 0 or any(blob is None for _, blob in outcomes):
        failure = result.failure
        if failure is None:
            raise WorkerFailedError(f"the elastic job ended with status {result.exitcode} and "
                                    f"no worker failure to report", rank=None,
                                    exitcode=result.exitcode, host=None, detail="")
        blob = store.get(f"{RESULT_PREFIX}w{failure.rank}")
        raise _failure_error(failure, cloudpickle.loads(blob) if blob else None)
    values = []
    for wid, blob in outcomes:
        status, value = cloudpickle.loads(blob)
        if status != "ok":
            raise WorkerFailedError(f"worker {wid} raised:\n{value}", rank=None, exitcode=1,
                                    host=None, detail=value)
        values.append(value)
    return values


def _same(name, value, other_name, other):
    """One value given under two names (hora's and Horovod's): they must agree."""
    if value is not None and other is not None and value != other:
        raise ValueError(f"run({name}={value!r}, {other_name}={other!r}): the two name the "
                         f"same setting; give one")
    return value if value is not None else other


def _ssh(ssh, port, identity_file):
    """``ssh`` with Horovod's ``ssh_port`` / ``ssh_identity_file`` filled in."""
    if ssh is None:
        return SshSettings(port=port, identity_file=identity_file)
    if not isinstance(ssh, SshSettings):
        raise TypeError(f"ssh must be an SshSettings, got {ssh!r}")
    _same("ssh.port", ssh.port, "ssh_port", port)
    _same("ssh.identity_file", ssh.identity_file, "ssh_identity_file", identity_file)
    return dataclasses.replace(ssh, port=ssh.port if ssh.port is not None else port,
                               identity_file=ssh.identity_file or identity_file)


@contextlib.contextmanager
def _verbose(verbose):
    """While the job runs, the launcher logs its progress at DEBUG (``verbose``), and to
    stderr when nothing of this process's logging would show it."""
    if not verbose:
        yield
        return
    logger = logging.getLogger("hora.runner")
    previous = logger.level
    handler = None
    logger.setLevel(logging.DEBUG)
    if not logger.hasHandlers():        # the application configured no logging
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[hora] %(levelname)s: %(message)s"))
        logger.addHandler(handler)
    try:
        yield
    finally:
        logger.setLevel(previous)
        if handler is not None:
            logger.removeHandler(handler)


def _failure_error(exit, outcome):
    """The WorkerFailedError for one worker's exit and (maybe) its stored outcome."""
    how = proc.describe_exit(exit.returncode)
    if outcome is not None and outcome[0] == "error":
        detail = outcome[1]
        message = f"rank {exit.rank} (pid {exit.pid}, host {exit.host}) raised:\n{detail}"
    else:
        if outcome is not None:
            detail = f"returned a result, then {how}"
        elif exit.returncode == 0:
            detail = f"{how} without reporting a result (os._exit?)"
        else:
            detail = f"{how} without reporting a result"
        message = f"rank {exit.rank} (pid {exit.pid}, host {exit.host}) {detail}"
    return WorkerFailedError(message, rank=exit.rank, exitcode=exit.returncode, host=exit.host,
                             detail=detail)


def _pythonpath(extra):
    """PYTHONPATH for the workers: ``extra`` entries, then this process's ``sys.path``."""
    entries = extra.split(os.pathsep) if extra else []
    for entry in sys.path:
        path = os.path.abspath(entry or os.getcwd())
        if os.path.exists(path):
            entries.append(path)
    return os.pathsep.join(dict.fromkeys(e for e in entries if e))
