"""hora's shared-memory segments: making one that every rank of a host maps, their names,
and their removal after a crash.

:func:`shared_segment` is collective: rank 0 creates the file, its name goes to every rank
(along the ring in a large group, where each rank talks to its neighbours only:
:mod:`hora.core.links`), every rank maps it, and rank
0 unlinks it as soon as every rank has mapped it, so nothing is left in ``/dev/shm`` however
a process ends afterwards.  Only a kill during the few milliseconds of set-up could leave
one: segments are named ``hora-<pid>-...`` after the creating process, and the launcher
removes those of its workers when the job ends.  The naming rule lives in
:mod:`hora.config` (the launcher removes a dead rank's segments by name without importing a
backend).  The shared-memory plane (:mod:`hora.backends.shm`) and the board
(:mod:`hora.core.dataplane`) make their segments here.

Layer: backends.  Knows nothing of collectives.
"""
import logging
import mmap
import os

from ..config import SEGMENT_DIR, SEGMENT_PREFIX, remove_segments_of
from .ring import DIRECT_MAX

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
            _chain(t, name_buf)
        except BaseException:
            _close_unlink(fd, path)     # a peer died: leave nothing in /dev/shm
            raise
    else:
        _chain(t, name_buf)
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
        status = vote(t, mapping is not None)
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


def vote(t, ok):
    """A barrier over transport ``t`` that also tells whether every rank says ``ok``.

    In a small group each rank sends one byte to every other.  In a larger one it goes
    along the ring, which needs no connection but a rank's neighbours: rank 0's byte goes
    round once gathering every rank's answer (when it is back every rank has voted), then
    round again with the verdict (2(N-1) hops)."""
    n, r = t.size, t.rank
    if n == 1:
        return ok
    if n <= DIRECT_MAX:
        peers = [p for p in range(n) if p != r]
        mine = memoryview(bytes([1 if ok else 0]))
        theirs = {p: bytearray(1) for p in peers}
        t.exchange([(p, mine) for p in peers], [(p, memoryview(theirs[p])) for p in peers])
        return ok and all(b[0] == 1 for b in theirs.values())
    b = bytearray([1 if ok else 0])
    if r != 0:
        t.recv(r - 1, memoryview(b))    # the answers of ranks 0 .. r-1
        b[0] &= 1 if ok else 0
    t.send((r + 1) % n, memoryview(b))
    if r == 0:
        t.recv(n - 1, memoryview(b))    # every rank's answer
    _chain(t, b)
    return bool(b[0])


def _chain(t, buf):
    """Rank 0's ``buf`` to every rank: straight in a small group, else along the ring (rank r
    receives it from r-1 and passes it to r+1)."""
    n, r = t.size, t.rank
    if n <= DIRECT_MAX:
        if r == 0:
            t.exchange([(p, memoryview(buf)) for p in range(1, n)], [])
        else:
            t.recv(0, memoryview(buf))
        return
    if r != 0:
        t.recv(r - 1, memoryview(buf))
    if r != n - 1:
        t.send(r + 1, memoryview(buf))


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
