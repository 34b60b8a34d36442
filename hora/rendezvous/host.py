"""What this process sees of its machine, as the launcher and ``init()`` both need it: the
running kernel (two processes share a machine's memory when they share it) and the CPUs
this process may run on.

Layer: rendezvous.  Imports nothing from hora.
"""
import os

__all__ = ["kernel_id", "usable_cpus"]


def usable_cpus():
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def kernel_id():
    """The running kernel's boot id: the same for every process under one kernel, containers
    and network namespaces included; "" where unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
