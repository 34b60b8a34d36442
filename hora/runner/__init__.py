"""The launcher: ``hora run`` (:mod:`hora.runner.cli`), :func:`launch` and :func:`run`.

Layer: runner.  May import hora.errors, hora.config and hora.rendezvous; never hora.core or
hora.backends (workers import those, the launcher does not).
"""
from .hosts import HostSpec, SlotInfo, assign_slots, parse_hostfile, parse_hosts
from .launch import SshSettings, launch
from .launch_config import LaunchConfig
from .run_func import run

__all__ = ["run", "launch", "LaunchConfig", "SshSettings", "HostSpec", "SlotInfo",
           "assign_slots", "parse_hosts", "parse_hostfile"]
