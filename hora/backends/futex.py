"""Sleeping on a word of shared memory until another process changes it (Linux futexes on
x86-64, through ctypes), for the waits that poll shared words: the shared-memory plane's
barriers and the board's replies.

A waiter reads the word, finds nothing new, says it sleeps (a flag of its own in shared
memory), then calls :func:`sleep_on` with the value it read: the kernel compares the word
first, after a full barrier of its own, so a word changed meanwhile returns at once.  A
waker stores the word, calls :func:`fence`, then reads the waiters' flags and calls
:func:`wake` for those that sleep.  Either the waker sees the flag or the kernel sees the
new word, so no wake-up is lost.  Every sleep is also bounded (``nap``): a waiter still
looks at its peers' liveness between two sleeps.

Layer: backends.
"""
import ctypes
import platform
import threading

__all__ = ["available", "address", "fence", "nap", "sleep_on", "wake"]

_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1        # x86-64; shared (not private) ops


def _load():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    return call


_futex = _load()


def available():
    """Whether this machine orders plain stores and loads as the words' users need (x86-64's
    TSO) and has the futex system call (Linux)."""
    return (platform.machine().lower() in ("x86_64", "amd64") and platform.system() == "Linux"
            and _futex is not None)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def nap(seconds):
    """The bound of a sleep of at most ``seconds``, for :func:`sleep_on` (make it once)."""
    whole = int(seconds)
    return ctypes.byref(_Timespec(whole, int((seconds - whole) * 1e9)))


def address(base, offset):
    """The address ``base + offset`` (bytes) as the futex calls take it (make it once)."""
    return ctypes.c_void_p(base + offset)


def sleep_on(addr, seen, bound):
    """Sleep until the 32-bit word at ``addr`` no longer holds ``seen``, someone wakes it,
    or ``bound`` (:func:`nap`) passes."""
    _futex(_SYS_FUTEX, addr, _FUTEX_WAIT, ctypes.c_uint32(seen), bound, None, 0)


def wake(addr, count=1):
    """Wake up to ``count`` sleepers on the word at ``addr``."""
    _futex(_SYS_FUTEX, addr, _FUTEX_WAKE, count, None, None, 0)


_LOCAL = threading.local()


def fence():
    """A full memory barrier (a lock's atomic instruction): a waker's store of a word is
    seen everywhere before it reads whether the word's waiter sleeps.  Each thread takes a
    lock of its own, which nobody else holds: its acquire always runs the atomic
    instruction (a failed try may only read the lock), and no thread releases another's."""
    lock = getattr(_LOCAL, "lock", None)
    if lock is None:
        lock = _LOCAL.lock = threading.Lock()
    lock.acquire()
    lock.release()
