"""The machine's limits, measured by ``hora bench`` to read its table against.

- numpy copy: ``np.copyto`` of a large buffer (bytes copied per second);
- numpy add: an in-place ``np.add`` (bytes of output per second): a ring step's reduction;
- loopback TCP: one stream between two processes;
- shared memory: one process writes a buffer into a ``/dev/shm`` mapping, another copies it
  out, pipelined through two slots (bytes delivered per second): the shm data plane's path.

Layer: bench.
"""
import mmap
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time
import uuid

import numpy as np

__all__ = ["measure_limits"]

MiB, GiB = 1 << 20, 1 << 30
SHM_SLOT = 4 * MiB


def _median_rate(fn, nbytes, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def _numpy_rates(nbytes, reps):
    """GB/s of np.copyto (bytes copied) and of an in-place np.add (bytes of the output)."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    b = np.ones_like(a)
    dst = np.empty_like(a)
    np.copyto(dst, a)                   # fault the pages in before timing
    copy = _median_rate(lambda: np.copyto(dst, a), nbytes, reps)
    b.fill(0.0)                         # a += 0: stays finite over the repetitions
    add = _median_rate(lambda: np.add(a, b, out=a), nbytes, reps)
    return copy, add


# -- loopback TCP -------------------------------------------------------------------------------
def _tcp_sink(port, nbytes):
    """Target of the receiving process: read ``nbytes`` from 127.0.0.1:port, then ack."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        buf = memoryview(bytearray(4 * MiB))
        for _ in range(2):              # one warm-up transfer, one timed
            left = nbytes
            while left:
                n = s.recv_into(buf[:min(left, len(buf))])
                if n == 0:
                    return
                left -= n
            s.sendall(b"k")


def _tcp_rate(nbytes):
    """GB/s of one loopback TCP stream between two processes (default socket options)."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        sink = mp.get_context("spawn").Process(target=_tcp_sink,
                                               args=(srv.getsockname()[1], nbytes), daemon=True)
        sink.start()
        srv.settimeout(60.0)
        conn, _ = srv.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        chunk = memoryview(bytearray(4 * MiB))
        rates = []
        for _ in range(2):
            t0 = time.perf_counter()
            left = nbytes
            while left:
                conn.sendall(chunk[:min(left, len(chunk))])
                left -= min(left, len(chunk))
            conn.recv(1)
            rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    sink.join(10.0)
    return rates[-1]


# -- shared memory between two processes --------------------------------------------------------
def _shm_reader(path, nbytes, passes, conn):
    """Target of the reading process: for each slot the writer announces, copy it out of the
    mapping into private memory and hand the slot back."""
    fd = os.open(path, os.O_RDWR)
    try:
        region = mmap.mmap(fd, 2 * SHM_SLOT)
    finally:
        os.close(fd)
    slots = [np.frombuffer(region, np.uint8, SHM_SLOT, i * SHM_SLOT) for i in range(2)]
    out = np.empty(nbytes, dtype=np.uint8)
    for _ in range(passes):
        done = 0
        while done < nbytes:
            slot, n = conn.recv()
            np.copyto(out[done:done + n], slots[slot][:n])
            done += n
            conn.send(slot)
    del slots
    region.close()


def _shm_rate(nbytes, passes=3):
    """GB/s delivered from one process's buffer into another's through a /dev/shm mapping
    of two slots: the writer fills one slot while the reader empties the other."""
    where = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(where, f"hora-bench-{uuid.uuid4().hex[:12]}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 2 * SHM_SLOT)
        region = mmap.mmap(fd, 2 * SHM_SLOT)
        os.close(fd)
        fd = None
        mine, theirs = mp.get_context("spawn").Pipe()
        reader = mp.get_context("spawn").Process(target=_shm_reader,
                                                 args=(path, nbytes, passes, theirs), daemon=True)
        reader.start()
        try:
            rates = [_shm_pass(region, nbytes, mine) for _ in range(passes)]
        finally:
            reader.join(30.0)
            if reader.is_alive():
                reader.kill()
                reader.join()
        region.close()
        return max(rates[1:] or rates)        # the first pass faults the reader's pages in
    finally:
        if fd is not None:
            os.close(fd)
        os.unlink(path)


def _shm_pass(region, nbytes, conn):
    src = np.ones(nbytes, dtype=np.uint8)
    slots = [np.frombuffer(region, np.uint8, SHM_SLOT, i * SHM_SLOT) for i in range(2)]
    free, done, sent = [0, 1], 0, 0
    t0 = time.perf_counter()
    while done < nbytes:
        if free and sent < nbytes:
            slot, n = free.pop(0), min(SHM_SLOT, nbytes - sent)
            np.copyto(slots[slot][:n], src[sent:sent + n])
            conn.send((slot, n))
            sent += n
        else:
            free.append(conn.recv())
            done += min(SHM_SLOT, nbytes - done)
    rate = nbytes / (time.perf_counter() - t0) / 1e9
    del slots
    return rate


def measure_limits(quick):
    """``{name: value}``: the rates above (GB/s, GB = 1e9 B) and the bytes each one moved."""
    copy_bytes, tcp_bytes = (64 * MiB, 128 * MiB) if quick else (256 * MiB, GiB)
    copy, add = _numpy_rates(copy_bytes, 3 if quick else 5)
    return {"numpy_copy_gbps": copy, "numpy_add_gbps": add, "numpy_bytes": copy_bytes,
            "tcp_stream_gbps": _tcp_rate(tcp_bytes), "tcp_bytes": tcp_bytes,
            "shm_gbps": _shm_rate(copy_bytes), "shm_bytes": copy_bytes}
