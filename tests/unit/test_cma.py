"""hora.backends.cma: reading a process's memory with process_vm_readv."""
import ctypes
import errno
import multiprocessing
import os
import time

import numpy as np
import pytest

from hora.backends import cma

pytestmark = pytest.mark.skipif(not cma.available(), reason="no process_vm_readv here")


def _free_pid():
    """A pid no process has: a child's, once reaped."""
    p = multiprocessing.get_context("fork").Process(target=lambda: None)
    p.start()
    p.join()
    return p.pid


def _owner(conn):
    a = np.arange(1 << 18, dtype=np.float64)        # 2 MiB
    conn.send((os.getpid(), a.ctypes.data))
    conn.recv()                                     # until the reader is done


def test_reads_another_processes_buffer():
    here, there = multiprocessing.get_context("fork").Pipe()
    p = multiprocessing.get_context("fork").Process(target=_owner, args=(there,))
    p.start()
    try:
        pid, addr = here.recv()
        out = np.zeros(1 << 18, dtype=np.float64)
        cma.read(pid, addr + 8 * 1000, out.ctypes.data, 8 * 5000)
        np.testing.assert_array_equal(out[:5000], np.arange(1000, 6000))
        assert not out[5000:].any()
        here.send(None)
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()


def test_a_gone_process_is_esrch_and_fails_the_probe():
    pid = _free_pid()
    word = ctypes.c_uint64(42)
    with pytest.raises(OSError) as e:
        cma.read(pid, ctypes.addressof(word), ctypes.addressof(word), 8)
    assert e.value.errno == errno.ESRCH
    assert not cma.probe(pid, ctypes.addressof(word), 42)


def test_probe_checks_the_word():
    word = ctypes.c_uint64(0x1234_5678_9ABC)
    assert cma.probe(os.getpid(), ctypes.addressof(word), 0x1234_5678_9ABC)
    assert not cma.probe(os.getpid(), ctypes.addressof(word), 7)
    assert not cma.probe(os.getpid(), 8, 0)         # an address mapped nowhere: EFAULT


def test_gone_tells_a_process_without_memory_from_a_live_one():
    assert cma.gone(_free_pid())
    assert not cma.gone(os.getpid())
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                    # alive until told, then a zombie
        os.read(r, 1)
        os._exit(0)
    try:
        assert not cma.gone(pid)
        os.write(w, b"x")
        deadline = time.monotonic() + 10
        while _state(pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(pid) == "Z" and cma.gone(pid)     # (not reaped yet: no memory)
    finally:
        os.close(r)
        os.close(w)
        os.waitpid(pid, 0)


def _state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(") ", 1)[1][0]
