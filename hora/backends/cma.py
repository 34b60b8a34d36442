"""Reading another process's memory directly (Linux's cross-memory attach: the
``process_vm_readv`` system call, through ctypes), for the shared-memory plane's large
reduce-scatters, allgathers and allreduces.

Through a shared segment, a block goes from one rank's buffer to another's in two copies:
its owner writes it into the segment, the reader copies it out.  ``process_vm_readv`` makes
it one: the kernel copies from the owner's buffer straight into the reader's.  The owner
must keep the buffer as it is until every reader is done, which the caller's barriers see
to.

The call needs the right to trace the other process (same user, not made undumpable, no
Yama ``ptrace_scope`` above 1 or a seccomp filter that refuses it, as some containers
have): :func:`probe` tries it on a peer before a group relies on it, and every rank of the
group must agree (the owner's side changes too).  ``HORA_SHM_CMA=0`` turns it off.

Layer: backends.
"""
import ctypes
import errno
import os
import platform

__all__ = ["available", "read", "probe", "gone"]


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load():
    if platform.system() != "Linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                   ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
    return fn


_readv = _load()


def available():
    """Whether this system has the call at all (whether a peer may be read: :func:`probe`)."""
    return _readv is not None


def read(pid, remote, local, nbytes):
    """Copy ``nbytes`` from address ``remote`` of process ``pid`` to address ``local`` of
    this one; OSError when the kernel refuses (the peer is gone: ESRCH; it may not be read:
    EPERM; the address is not mapped there: EFAULT)."""
    here, there = _Iovec(local, nbytes), _Iovec(remote, nbytes)
    done = 0
    while done < nbytes:
        if done:                        # (the kernel stopped short: read on from there)
            here.base, here.len = local + done, nbytes - done
            there.base, there.len = remote + done, nbytes - done
        n = _readv(pid, ctypes.byref(here), 1, ctypes.byref(there), 1, 0)
        if n <= 0:
            code = ctypes.get_errno() if n < 0 else errno.EFAULT
            raise OSError(code, os.strerror(code))
        done += n


def probe(pid, remote, expected):
    """Whether the 8-byte word at ``remote`` in process ``pid`` can be read here and holds
    ``expected``."""
    if not available():
        return False
    word = ctypes.c_uint64(0)
    try:
        read(pid, remote, ctypes.addressof(word), 8)
    except OSError:
        return False
    return word.value == expected


def gone(pid):
    """Whether process ``pid`` has no memory left to read: it has exited, or is exiting (a
    process lets go of its memory before its files, so its connections may still be open),
    or there is no such process.  False where it cannot be told (no such call, EPERM)."""
    if not available():
        return False
    byte = ctypes.c_uint8(0)
    try:
        read(pid, 0, ctypes.addressof(byte), 1)     # (address 0: EFAULT where it lives)
    except OSError as e:
        return e.errno == errno.ESRCH
    return False
