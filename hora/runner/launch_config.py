"""What a launch is asked to do: :class:`LaunchConfig`, built once by the command line
(:mod:`hora.runner.cli`) or the Python API (:func:`hora.runner.launch`,
:func:`hora.runner.run`) and read by whatever starts the workers (:class:`~hora.runner.launcher.Job`,
:func:`~hora.runner.mpi_run.mpi_launch`).

Layer: runner.  Imports nothing from hora but the settings (:mod:`hora.config`) and the
runner's own modules.
"""
import dataclasses
import logging
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ..config import MAX_SECONDS, check_settings, check_writable_file, timeline_file
from .remote import DEFAULT_CHECK_TIMEOUT_S, SshSettings
from .supervisor import DEFAULT_GRACE_S

__all__ = ["LaunchConfig", "script_command", "interface_list", "one_interface"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """One job: what runs, where, and how it is watched.

    Attributes:
        command: the argv every worker runs; a first word that ends in ``.py`` runs with
            this Python unless it runs by itself (:func:`script_command`).
        np: number of processes (ranks).
        hosts: ``"host1:4,host2:2"`` (``-H``), or a list of HostSpec; default ``localhost:np``.
        hostfile: path of a hostfile (exclusive with ``hosts``).
        env: extra environment variables for every worker (over this process's).
        prefix_output: tag each forwarded line with ``[<rank>]<stdout>:`` / ``<stderr>``.
        output_filename: also write each rank's output under ``DIR/rank.<r>/``.
        timeout_s: overall limit in seconds (None: no limit).
        start_timeout: seconds for every rank to reach ``hora.init()`` (``HORA_START_TIMEOUT``
            for the workers; None keeps their default).
        grace_s: seconds between SIGTERM and SIGKILL when the job is torn down.
        store: key/values put into the rendezvous store before any worker starts.
        ssh: :class:`SshSettings` for remote hosts (port, identity file, command template).
        network_interface: interface the data plane binds to on every host (``HORA_IFACE``):
            a name, Horovod's ``"eth0,eth1"`` or a list, of which the data plane binds the
            first (Open MPI's traffic, under ``--mpi``, may use them all).
        check_timeout: seconds for the start-up check of the remote hosts.
        monitor: show a status line per rank below the output (a terminal only; see
            :mod:`hora.runner.monitor`).

    Raises:
        TypeError: ``command`` is a string, not a list of arguments.
        ValueError: a timeout that is not a positive number of seconds (at most
            :data:`hora.config.MAX_SECONDS`), a negative ``grace_s``, or no command.
        SettingError: a ``HORA_*``/``HOROVOD_*`` setting of ``env`` (or of this process's
            environment, which the workers inherit) has a value it does not accept.
    """
    command: Sequence[str]
    np: int
    hosts: "str | Sequence[Any] | None" = None
    hostfile: "str | os.PathLike | None" = None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    prefix_output: bool = True
    output_filename: "str | os.PathLike | None" = None
    timeout_s: "float | None" = None
    start_timeout: "float | None" = None
    grace_s: float = DEFAULT_GRACE_S
    store: Mapping[str, bytes] = dataclasses.field(default_factory=dict)
    ssh: "SshSettings | None" = None
    network_interface: "str | Sequence[str] | None" = None
    check_timeout: "float | None" = DEFAULT_CHECK_TIMEOUT_S
    monitor: bool = False

    def __post_init__(self):
        if isinstance(self.command, (str, bytes)):
            raise TypeError(f"command must be a list of arguments, got the string "
                            f"{self.command!r}")
        _check_timeout("timeout_s", self.timeout_s)
        _check_timeout("start_timeout", self.start_timeout)
        _check_timeout("check_timeout", self.check_timeout)
        if not self.command:
            raise ValueError("no command to run")
        if not self.grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s!r}")
        # frozen: copies, so that the caller's lists and dicts may change afterwards
        set_ = object.__setattr__
        set_(self, "command", script_command([os.fspath(c) for c in self.command]))
        set_(self, "env", dict(self.env or {}))
        set_(self, "store", dict(self.store or {}))
        # the workers would each fail on it: fail once, before any starts
        check_settings(self.worker_environment())

    def worker_environment(self):
        """The settings the workers start with: ``env`` over this process's environment."""
        return {**os.environ, **self.env}

    def check_timeline(self):
        """Refuse a timeline file (``HORA_TIMELINE``) that rank 0 could not write, for a
        launcher that starts rank 0 on this machine (in this directory).

        Raises:
            SettingError: naming the file and why it cannot be written.
        """
        path = timeline_file(self.worker_environment())
        if path:
            check_writable_file("HORA_TIMELINE", path)


def script_command(command, python=None):
    """``command`` with a Python script as its first word run by ``python``, as torchrun runs
    its script: ``train.py --lr 0.1`` becomes ``<python> train.py --lr 0.1``.

    A first word that ends in ``.py`` is left as it is only where it runs by itself: an
    executable file that starts with ``#!``, found as ``exec`` finds it (by its path, or on
    ``PATH`` where it has no ``/``).  Anything else (a script without the execute bit, one
    without ``#!``, one in the current directory but not on ``PATH``, one not found here)
    would fail to start, so it runs with ``python``.  On remote hosts that is the same path,
    the one hora's own agent already runs with there (:mod:`hora.runner.remote`); under
    ``--mpi``, mpirun starts it on every host.

    Args:
        command: the program and its arguments.
        python: the interpreter (default ``sys.executable``, the launcher's).

    Returns:
        A new list: ``command``, or ``[python, *command]``.
    """
    command = list(command)
    first = command[0] if command else ""
    if not first.endswith(".py"):
        return command
    found = first if os.sep in first else shutil.which(first)
    if found is not None and _runs_by_itself(found):
        return command
    return [python or sys.executable, *command]


def _runs_by_itself(path):
    """Whether ``exec`` can start the file at ``path``: executable, with a ``#!`` line."""
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        return False
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


def _check_timeout(name, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not 0 < value <= MAX_SECONDS):
        raise ValueError(f"{name} must be a positive number of seconds (at most "
                         f"{MAX_SECONDS:g}) or None, got {value!r}")


def interface_list(value):
    """The network interfaces named by ``value``, in Horovod's forms, as a list of names.

    Args:
        value: None, ``"eth0"``, ``"eth0,eth1"`` (``--network-interfaces``), or a list or
            set of names (``--network-interface`` given several times).

    Raises:
        TypeError: ``value`` is none of these.
    """
    if value is None:
        return []
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, (list, tuple, set, frozenset)) and all(
            isinstance(v, str) for v in value):
        items = [part for v in value for part in v.split(",")]
    else:
        raise TypeError(f"network interfaces must be a name, a comma-separated string or a "
                        f"list of names, got {value!r}")
    return list(dict.fromkeys(i.strip() for i in items if i.strip()))


def one_interface(value):
    """The interface the data plane binds to: hora's binds one per host (Horovod's may use
    several), so of several the first is used, and a warning says so."""
    names = interface_list(value)
    if len(names) > 1:
        log.warning("hora's data plane binds one network interface: using %s, not %s",
                    names[0], ", ".join(names[1:]))
    return names[0] if names else None
