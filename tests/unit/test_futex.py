"""hora.backends.futex: the fence from several threads at once, and a sleep on a word that
another thread changes and wakes."""
import mmap
import sys
import threading
import time

import numpy as np
import pytest

from hora.backends import futex

pytestmark = [pytest.mark.timeout(30),
              pytest.mark.skipif(not futex.available(), reason="x86-64 Linux only")]


def test_fences_from_several_threads_at_once():
    """The shared-memory plane fences on the engine's thread while a caller fences on the
    board: no thread may release another's lock (a shared lock did: 'release unlocked
    lock')."""
    errors = []

    def hammer():
        try:
            for _ in range(50_000):
                futex.fence()
        except Exception as e:      # reported below
            errors.append(repr(e))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)     # switch threads as often as possible
    try:
        threads = [threading.Thread(target=hammer) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    finally:
        sys.setswitchinterval(interval)
    assert errors == []


def test_a_sleeper_wakes_when_the_word_changes():
    area = mmap.mmap(-1, 4096)
    words = np.frombuffer(area, dtype=np.int64, count=1)
    addr = futex.address(words.ctypes.data, 0)
    bound = futex.nap(5.0)
    woke = []

    def sleeper():
        t0 = time.monotonic()
        while words[0] == 0:
            futex.sleep_on(addr, 0, bound)
        woke.append(time.monotonic() - t0)

    t = threading.Thread(target=sleeper)
    t.start()
    time.sleep(0.2)                 # the sleeper is in the kernel by now
    words[0] = 7
    futex.fence()
    futex.wake(addr, 1)
    t.join(10)
    assert woke and 0.15 < woke[0] < 2.0    # woken, well before its 5 s bound


def test_a_sleep_returns_at_once_on_a_changed_word_and_by_its_bound():
    area = mmap.mmap(-1, 4096)
    words = np.frombuffer(area, dtype=np.int64, count=1)
    words[0] = 3
    addr = futex.address(words.ctypes.data, 0)
    t0 = time.monotonic()
    futex.sleep_on(addr, 2, futex.nap(5.0))     # the word holds 3, not 2: no sleep
    assert time.monotonic() - t0 < 0.5
    t0 = time.monotonic()
    futex.sleep_on(addr, 3, futex.nap(0.05))    # nobody wakes it: its bound ends it
    assert 0.04 < time.monotonic() - t0 < 1.0
