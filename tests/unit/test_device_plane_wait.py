"""The device plane's wait for the GPU (hora.backends.nccl.TensorGroup._wait), which only a
GPU reaches in the multi-process tests: it ends when the event has happened, raises naming
the peer that hora's connections saw go (and aborts the communicator), and gives up after
the timeout.  The event and the transport are stand-ins with the same calls."""
import time

import pytest

from hora.backends.nccl import TensorGroup
from hora.errors import HoraInternalError, TransportBrokenError


class _Event:
    def __init__(self, done_after=None):
        self.looks, self.done_after = 0, done_after

    def query(self):
        self.looks += 1
        return self.done_after is not None and self.looks > self.done_after


class _Transport:
    def __init__(self, lost_after=None):
        self.watches, self.lost_after = 0, lost_after

    def watch(self, timeout=None):
        self.watches += 1
        if self.lost_after is not None and self.watches > self.lost_after:
            raise TransportBrokenError("lost connection to rank 1", rank=1)
        time.sleep(timeout)
        return set()


class _Group:
    def __init__(self):
        self.aborted = 0

    def abort(self):
        self.aborted += 1


def _plane(t, timeout=5.0):
    plane = object.__new__(TensorGroup)         # no process group: only _wait is used
    plane._t, plane._timeout, plane._pg = t, timeout, _Group()
    plane.rank, plane._label = 0, "nccl"
    return plane


def test_returns_once_the_event_has_happened():
    plane = _plane(_Transport())
    event = _Event(done_after=2000)
    plane._wait(event)
    assert event.looks == 2001 and plane._pg.aborted == 0


def test_a_lost_peer_aborts_the_communicator_and_is_raised():
    plane = _plane(_Transport(lost_after=3))
    with pytest.raises(TransportBrokenError, match="rank 1"):
        plane._wait(_Event())
    assert plane._pg.aborted == 1


def test_gives_up_after_the_timeout_while_every_peer_lives():
    plane = _plane(_Transport(), timeout=0.3)
    start = time.monotonic()
    with pytest.raises(HoraInternalError, match="did not finish within 0.3 s"):
        plane._wait(_Event())
    assert 0.3 <= time.monotonic() - start < 2.0
    assert plane._pg.aborted == 1
