"""What this process sees of its machine, as the launcher and ``init()`` both need it: the
running kernel (two processes share a machine's memory when they share it), the CPUs this
process may run on, and the files it may open.

Layer: rendezvous.  Imports nothing from hora.
"""
import os
import resource

__all__ = ["kernel_id", "usable_cpus", "open_files"]


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


def open_files(needed):
    """Raise this process's limit of open files (its soft ``RLIMIT_NOFILE``, which its
    children inherit) to ``needed``, or as far as the hard limit allows; never lower it.
    Returns the limit now (``resource.RLIM_INFINITY`` for none).  Many systems start
    processes at 1,024 of a far higher hard limit: a launcher holds pipes and connections
    for each of its ranks, and a rank may connect to every other."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft
    raised = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
    if raised > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    return soft
