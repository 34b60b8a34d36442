"""How much of the machine other processes used while a benchmark measured something, so
that a table can say whether its numbers were taken on a quiet machine.  Imported by the
benchmark scripts beside it (Linux: reads /proc/stat; elsewhere the share is None)."""
import os
import resource
import time


def _busy_s():
    """Seconds of CPU time every process of the machine has used, else None."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _children_s():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def others_share(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), share)``: share is the fraction of all CPUs that processes
    other than this one's (waited-for) children used while ``fn`` ran, or None."""
    busy, ours, t0 = _busy_s(), _children_s(), time.monotonic()
    result = fn(*args, **kwargs)
    busy_after, wall = _busy_s(), time.monotonic() - t0
    if busy is None or busy_after is None:
        return result, None
    others = (busy_after - busy) - (_children_s() - ours)
    return result, max(0.0, others / (wall * (os.cpu_count() or 1)))
