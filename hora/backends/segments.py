"""The names of hora's shared-memory segments, and their removal after a crash.

Apart from :mod:`hora.backends.shm` (which needs NumPy) so that the launcher can clean up
after its workers without importing NumPy.  Layer: backends.
"""
import os

__all__ = ["SEGMENT_DIR", "SEGMENT_PREFIX", "remove_segments_of"]

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
