"""The launcher: ``hora run`` (:mod:`hora.runner.cli`), :func:`launch` and :func:`run`.

The names below are imported on first use (PEP 562), so that a process that needs one module
of the package imports that one alone: a remote rank's agent (:mod:`hora.runner.remote_agent`)
starts once a rank, and pays only for :mod:`hora.runner.proc`.

Layer: runner.  May import hora.errors, hora.config and hora.rendezvous; never hora.core or
hora.backends (workers import those, the launcher does not).
"""
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:       # what editors and type checkers see
    from .hosts import HostSpec, SlotInfo, assign_slots, parse_hostfile, parse_hosts  # noqa: F401
    from .launch_config import LaunchConfig  # noqa: F401
    from .launcher import launch  # noqa: F401
    from .remote import SshSettings  # noqa: F401
    from .run_func import run  # noqa: F401

__all__ = ["run", "launch", "LaunchConfig", "SshSettings", "HostSpec", "SlotInfo",
           "assign_slots", "parse_hosts", "parse_hostfile"]

_HOME = {"run": "run_func", "launch": "launcher", "LaunchConfig": "launch_config",
         "SshSettings": "remote", "HostSpec": "hosts", "SlotInfo": "hosts",
         "assign_slots": "hosts", "parse_hosts": "hosts", "parse_hostfile": "hosts"}


def __getattr__(name):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *__all__})
