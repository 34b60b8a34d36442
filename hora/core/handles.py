"""Handles: what an asynchronous collective returns.  Layer: core."""
from __future__ import annotations

import threading
import time
from typing import Any, Optional

from ..errors import CollectiveTimeoutError

__all__ = ["Handle"]

_EVENTS = threading.Lock()      # orders a handle's completion against a waiter's first sleep


class Handle:
    """The future result of one collective.

    ``poll()`` says whether it finished; ``wait()`` blocks until it does and returns the
    result or raises the collective's error.  Waits are bounded: the engine fails every
    pending handle when the job breaks, and ``wait(timeout)`` gives up after ``timeout`` s.
    """

    __slots__ = ("name", "inplace", "_done", "_event", "_result", "_error", "_engine",
                 "_finish")

    def __init__(self, name, engine=None, finish=None):
        self.name = name
        self.inplace = False
        self._done = False
        self._event = None         # made by the first wait that has to sleep
        self._result = None
        self._error = None
        self._engine = engine
        self._finish = finish      # optional post-processing of the raw result

    def _set_result(self, result):
        self._result = result
        self._set_done()

    def _set_error(self, error):
        self._error = error
        self._set_done()

    def _set_done(self):
        with _EVENTS:
            self._done = True
            event = self._event
        if event is not None:
            event.set()

    def _sleep(self, timeout):
        """Sleep until done or ``timeout`` s; True when done."""
        with _EVENTS:
            if self._done:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def poll(self) -> bool:
        """True when the collective has finished (successfully or not)."""
        return self._done

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until done; return the result or raise the collective's error.

        Args:
            timeout: seconds to wait at most; None waits as long as the job is alive (the
                engine's liveness checks fail the handle when a peer dies).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._engine is not None and not self._done:
            self._engine.drive(self, deadline)
        while not self._done and not self._sleep(
                1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))):
            if deadline is not None and time.monotonic() >= deadline:
                raise CollectiveTimeoutError(
                    f"collective {self.name!r} did not finish within {timeout:g} s")
            if self._engine is not None and not self._engine.alive and not self.poll():
                raise self._engine.failure(f"collective {self.name!r}")
        if self._error is not None:
            raise self._error
        if self._finish is not None:
            self._result, self._finish = self._finish(self._result), None
        return self._result

    def __repr__(self):
        state = "done" if self.poll() else "pending"
        return f"<hora.Handle {self.name!r} {state}>"
