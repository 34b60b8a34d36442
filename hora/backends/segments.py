"""hora's shared-memory segments: making one that every rank of a host maps, their names,
and their removal after a crash.

:func:`shared_segment` is collective: rank 0 creates the file, broadcasts its name
(:mod:`hora.backends.ring`: along the ring in a large group, so that a rank talks to its
neighbours only), every rank maps it, and rank 0 unlinks it as soon as every rank has mapped
it, so nothing is left in ``/dev/shm`` however
a process ends afterwards.  Only a kill during the few milliseconds of set-up could leave
one: segments are named ``hora-<pid>-...`` after the creating process, and the launcher
removes those of its workers when the job ends.  The naming rule lives in
:mod:`hora.config` (the launcher removes a dead rank's segments by name without importing a
backend).  The shared-memory plane (:mod:`hora.backends.shm`) and the board
(:mod:`hora.core.dataplane`) make their segments here.

Layer: backends.  Knows nothing of names or requests; its two messages go through
:mod:`hora.backends.ring`.
"""
import logging
import mmap
import os

import numpy as np

from ..config import SEGMENT_DIR, SEGMENT_PREFIX, remove_segments_of
from . import ring

__all__ = ["SEGMENT_DIR", "SEGMENT_PREFIX", "remove_segments_of", "shared_segment",
           "shm_bytes", "vote"]

log = logging.getLogger(__name__)

_NAME_LEN = 96              # bytes of a segment's path sent to the other ranks


def shared_segment(t, total, tag):
    """Collective over transport ``t`` (every rank on this host): a new segment of ``total``
    zeroed bytes that every rank maps, or None on every rank when some rank could not
    (logged).  Rank 0 creates it as ``hora-<pid>-<tag>`` and unlinks it once every rank has
    mapped it (or given up, or died)."""
    rank = t.rank
    name_buf = bytearray(_NAME_LEN)
    fd, path, mapping, error = -1, None, None, None
    if rank == 0:
        path = os.path.join(SEGMENT_DIR, f"{SEGMENT_PREFIX}{os.getpid()}-{tag}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            # reserve the pages now: a full tmpfs fails here with ENOSPC instead of
            # killing a rank with SIGBUS at its first write
            os.posix_fallocate(fd, 0, total)
            mapping = mmap.mmap(fd, total)
            encoded = path.encode()
            name_buf[:len(encoded)] = encoded
        except OSError as e:
            error = e
            _close_unlink(fd, path)
            fd, path = -1, None
        try:
            ring.broadcast(t, np.frombuffer(name_buf, dtype=np.uint8), 0, direct=False)
        except BaseException:
            _close_unlink(fd, path)     # a peer died: leave nothing in /dev/shm
            raise
    else:
        ring.broadcast(t, np.frombuffer(name_buf, dtype=np.uint8), 0, direct=False)
        encoded = bytes(name_buf).rstrip(b"\0")
        if encoded:
            try:
                fd = os.open(encoded.decode(), os.O_RDWR)
                mapping = mmap.mmap(fd, total)
            except OSError as e:
                error = e
        else:
            error = OSError("rank 0 could not create the segment")
    if fd >= 0 and rank != 0:
        os.close(fd)
    try:
        status = vote(t, mapping is not None, direct=False)
    finally:
        if rank == 0 and path is not None:
            _close_unlink(fd, path)     # every rank has it mapped, gave up or died
    if not status:
        if mapping is not None:
            mapping.close()
        if error is not None:
            log.warning("rank %d: shared memory unavailable (%s); using TCP on this host",
                        rank, error)
        return None
    return mapping


def shm_bytes():
    """The size of the file system that holds the segments (``/dev/shm``: a container's is
    often 64 MiB), the same for every process of the host; 0 when it cannot be read."""
    try:
        st = os.statvfs(SEGMENT_DIR)
    except OSError:
        return 0
    return st.f_blocks * st.f_frsize


def vote(t, ok, direct=None):
    """A barrier over transport ``t`` that also tells whether every rank says ``ok``: the
    minimum of one byte, by :func:`.ring.allreduce` (straight to every peer in a small
    group, else along the ring, which needs no connection but a rank's neighbours;
    ``direct``: as :func:`.ring.allreduce` takes it)."""
    vote = np.array([1 if ok else 0], dtype=np.uint8)
    ring.allreduce(t, vote, np.minimum, direct=direct)
    return bool(vote[0])


def _close_unlink(fd, path):
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass
