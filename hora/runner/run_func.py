"""``hora.run(fn, np=...)``: call a Python function on every rank of a local job.

The launcher pickles ``(fn, args, kwargs)`` with cloudpickle into the job's rendezvous store;
each worker runs ``python -m hora.runner.task`` (:mod:`hora.runner.task`), which fetches it,
calls it and stores its return value or traceback.  The parent's ``sys.path`` is passed on
through ``PYTHONPATH`` (as multiprocessing's spawn does) so that functions defined in the
caller's modules unpickle in the workers.

Layer: runner.
"""
import os
import signal
import sys

import cloudpickle

from ..errors import WorkerFailedError
from . import proc
from .launch import DEFAULT_GRACE_S, build_job

__all__ = ["run", "FN_KEY", "RESULT_PREFIX"]

# rendezvous keys shared with the worker side (hora.runner.task, which must not be imported
# here: it runs as ``python -m hora.runner.task``)
FN_KEY = "run/fn"
RESULT_PREFIX = "run/result/"


def run(fn, args=(), kwargs=None, np=2, hosts=None, hostfile=None, env=None, timeout_s=None,
        start_timeout=None, prefix_output=True, output_filename=None, grace_s=DEFAULT_GRACE_S,
        executable=None, ssh=None, network_interface=None):
    """Run ``fn(*args, **kwargs)`` on ``np`` worker processes; return their results by rank.

    The function runs in fresh processes, so it calls ``hora.init()`` itself when it needs
    collectives (as with ``horovod.run``).  Workers' output is forwarded to this process's
    stdout/stderr, tagged by rank.

    Example:
        >>> def work():
        ...     import hora
        ...     hora.init()
        ...     return hora.rank()
        >>> hora.run(work, np=2)                          # doctest: +SKIP
        [0, 1]

    Args:
        fn: the function (anything cloudpickle can pickle).
        args, kwargs: its arguments, the same on every rank.
        np: number of processes.
        hosts, hostfile, ssh, network_interface: as for :func:`hora.runner.launch`.
        env: extra environment variables for the workers.
        timeout_s: overall limit in seconds (None: no limit).
        start_timeout: seconds for a worker to fetch the function and for every rank to
            reach ``hora.init()`` (None: the ``HORA_START_TIMEOUT`` default).
        prefix_output, output_filename, grace_s: as for :func:`hora.runner.launch`.
        executable: the Python interpreter of the workers (default: ``sys.executable``).

    Returns:
        ``[fn's return value on rank 0, on rank 1, ...]``.

    Raises:
        WorkerFailedError: a worker raised or died; describes the earliest failure (``rank``,
            ``exitcode`` (negative: killed by that signal), ``host``, and ``detail``: the
            worker's traceback, or how it died).
        CollectiveTimeoutError: ``timeout_s`` passed; lists the ranks that were still running.
        KeyboardInterrupt: this process got SIGINT (the workers were stopped first).
        SystemExit: this process got SIGTERM (status 143; the workers were stopped first).
        ValueError: bad arguments.
    """
    blob = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    env = dict(env or {})
    env["PYTHONPATH"] = _pythonpath(env.get("PYTHONPATH"))
    command = [executable or sys.executable, "-m", "hora.runner.task"]
    job = build_job(command, np, hosts=hosts, hostfile=hostfile, env=env,
                    prefix_output=prefix_output, output_filename=output_filename,
                    timeout_s=timeout_s, start_timeout=start_timeout, grace_s=grace_s,
                    store={FN_KEY: blob}, ssh=ssh, network_interface=network_interface)
    result = job.run()
    if result.signal == signal.SIGINT:
        raise KeyboardInterrupt
    if result.signal is not None:
        raise SystemExit(result.exitcode)
    outcomes = {rank: cloudpickle.loads(result.store[key])
                for rank in range(np)
                if (key := f"{RESULT_PREFIX}{rank}") in result.store}
    if result.failure is not None:
        raise _failure_error(result.failure, outcomes.get(result.failure.rank))
    missing = [e for e in result.exits if e.rank not in outcomes]
    if missing:
        raise _failure_error(missing[0], None)
    return [outcomes[rank][1] for rank in range(np)]


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
