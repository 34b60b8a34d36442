"""The submission queue: requests from user threads, on their way to the engine's next step.

User threads append under :attr:`SubmissionQueue.lock` and call :meth:`wake`; whoever runs
the engine's step (the engine thread, or a caller in ``Engine.drive``) takes everything at
once with :meth:`take`.  The wake-up is a pipe, so that the engine thread can sleep in one
``poll`` over it and its sockets: one byte in the pipe means "look at the queue".  At most
one byte is outstanding: :meth:`wake` writes only when the last one has not been seen
(a write costs a system call, and a burst of submissions needs one look).  The names in
flight must be unique among a rank's outstanding collectives: a dict whose ``setdefault``
checks and takes a name in one step (one call, atomic under the GIL: the keys are tuples
of an int and a str), so that a blocking call of a loop takes its name without the lock.

Layer: core.
"""
import collections
import os
import threading

__all__ = ["SubmissionQueue"]


class SubmissionQueue:
    """A deque of submitted items, the names in flight, and the wake-up pipe.

    Attributes:
        lock: held while reading or changing :attr:`items`.
        items: what user threads submitted and no step has taken yet, in order.
        inflight: ``{(process set, name): mark}`` of every collective submitted and not
            finished; whoever takes a name puts it in with ``setdefault(key, mark)``, ``mark``
            an object of its own, and has it when it gets ``mark`` back.
        wake_fd: the pipe's read end, readable after :meth:`wake` (for ``poll``).
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.items = collections.deque()
        self.inflight = {}
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)
        self._signalled = False             # a byte is (about to be) in the pipe

    def wake(self):
        """Make the engine look at the queue (from any thread)."""
        if self._signalled:
            return                      # the engine has not read the last signal yet
        self._signalled = True
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass                        # already signalled, or closed at shutdown

    def seen(self):
        """A ``poll`` found the pipe readable: make sure the next :meth:`take` empties it."""
        self._signalled = True

    def take(self):
        """Everything queued, oldest first; empties the pipe of its wake-up."""
        if self._signalled:
            self._signalled = False     # cleared before reading: a later wake() writes again
            try:
                while os.read(self.wake_fd, 4096):
                    pass
            except (BlockingIOError, OSError):
                pass
        with self.lock:
            batch = list(self.items)
            self.items.clear()
        return batch

    def release(self, key):
        """The collective ``key`` finished: its name may be submitted again."""
        self.inflight.pop(key, None)

    def close(self):
        for fd in (self.wake_fd, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
