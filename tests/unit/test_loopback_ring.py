"""The ring plane over the in-process loopback transport, and the backend contracts.

Every rank is a thread with its own :class:`~hora.backends.loopback.LoopbackTransport`.
Results of :class:`~hora.backends.ring.RingPlane` are compared with numpy run on the
inputs directly (sum, min, max, product over a stacked array), on both sides of
``ring.SMALL`` (direct exchanges below, the ring above), with uneven and zero counts.  The
failure tests check that a closed peer makes the others raise within seconds, naming it.
"""
import os
import threading
import time

import numpy as np
import pytest

from hora.backends import ring
from hora.backends.base import NetworkTransport, Plane, Transport, WaitPolicy
from hora.backends.gloo import GlooGroup
from hora.backends.group import SubsetTransport
from hora.backends.hierarchical import Hierarchical
from hora.backends.loopback import loopback_group
from hora.backends.mpi import MpiGroup
from hora.backends.ring import RingPlane
from hora.backends.shm import ShmGroup
from hora.backends.tcp import TcpTransport
from hora.errors import CollectiveTimeoutError, TransportBrokenError, TransportClosedError
from tests.helpers import on_threads

pytestmark = pytest.mark.timeout(60)

_JOIN_S = 20.0          # per run; generous on a loaded 2-core machine
_PROMPT_S = 5.0         # a lost peer is noticed within about one 0.5 s slice
SIZES = [2, 3, 4]
_OPS = {"sum": (np.add, np.sum), "min": (np.minimum, np.min), "max": (np.maximum, np.max),
        "prod": (np.multiply, np.prod)}
_DTYPES = ["float32", "float64", "int32"]


# -- test-only helpers ---------------------------------------------------------------------
def run_ranks(size, fn, timeout=_JOIN_S, transports=None):
    """Run ``fn(transport)`` on one thread per rank; return the results in rank order.
    Fails naming the ranks that raised or did not finish in time."""
    transports = transports or loopback_group(size, timeout=timeout)
    return on_threads(transports, fn, timeout)


def _inputs(size, n, dtype, op, seed=0):
    """Integer-valued inputs (float sums are exact in any order); a product's factors are
    +-1 and +-2, so it stays exact and in range."""
    rng = np.random.default_rng([seed, size, n])
    if op == "prod":
        return [rng.choice([-2, -1, 1, 2], n).astype(dtype) for _ in range(size)]
    return [rng.integers(-50, 51, n).astype(dtype) for _ in range(size)]


def _oracle(xs, op, dtype):
    return _OPS[op][1](np.stack(xs), axis=0).astype(dtype)


def _big(dtype, factor=3):
    """An element count whose buffer is above ring.SMALL: the ring, not the direct path."""
    return factor * ring.SMALL // np.dtype(dtype).itemsize + 7


# -- allreduce -----------------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("path", ["empty", "direct", "ring"])
def test_allreduce_matches_numpy(size, path):
    for dtype in _DTYPES:
        n = {"empty": 0, "direct": 1001, "ring": _big(dtype)}[path]
        for op, (ufunc, _) in _OPS.items():
            xs = _inputs(size, n, dtype, op)

            def work(t, xs=xs, ufunc=ufunc):
                flat = xs[t.rank].copy()
                assert RingPlane(t).allreduce(flat, ufunc) is True
                return flat

            expected = _oracle(xs, op, dtype)
            for r, got in enumerate(run_ranks(size, work)):
                assert got.dtype == np.dtype(dtype)
                np.testing.assert_array_equal(got, expected,
                                              err_msg=f"{op} {dtype} n={n} rank {r}")


def test_allreduce_reuses_its_scratch_buffer():
    n, shared = _big("float64"), {}

    def work(t):
        plane = RingPlane(t, scratch=shared if t.rank == 0 else None)
        for _ in range(3):
            flat = np.full(n, t.rank + 1.0)
            plane.allreduce(flat, np.add)
        return flat

    for got in run_ranks(3, work):
        np.testing.assert_array_equal(got, np.full(n, 6.0))
    assert list(shared) == [np.dtype("float64")]
    assert shared[np.dtype("float64")].size == -(-n // 3)


# -- reduce-scatter and allgather ------------------------------------------------------------
_COUNTS = [[0, 0], [3, 4], [5, 0, 3], [0, 7, 0], [1, 1, 1, 1], [0, 0, 9, 2],
           [20_000, 0, 3], [9_000, 17, 0, 12_001]]


@pytest.mark.parametrize("counts", _COUNTS, ids=lambda c: "-".join(map(str, c)))
def test_reducescatter_uneven_counts(counts):
    size, n = len(counts), sum(counts)
    bounds = ring.segment_bounds(counts)
    for dtype in _DTYPES:
        for op, (ufunc, _) in _OPS.items():
            xs = _inputs(size, n, dtype, op, seed=1)

            def work(t, xs=xs, ufunc=ufunc):
                flat = xs[t.rank].copy()
                assert RingPlane(t).reducescatter(flat, counts, ufunc) is True
                return flat[bounds[t.rank]:bounds[t.rank + 1]]

            expected = _oracle(xs, op, dtype)
            for r, got in enumerate(run_ranks(size, work)):
                np.testing.assert_array_equal(got, expected[bounds[r]:bounds[r + 1]],
                                              err_msg=f"{op} {dtype} rank {r}")


@pytest.mark.parametrize("counts", _COUNTS, ids=lambda c: "-".join(map(str, c)))
def test_allgather_uneven_counts(counts):
    size, n = len(counts), sum(counts)
    bounds = ring.segment_bounds(counts)
    for dtype in _DTYPES:
        blocks = [np.arange(bounds[r], bounds[r + 1]).astype(dtype) * (r + 1)
                  for r in range(size)]

        def work(t, blocks=blocks, dtype=dtype):
            out = np.full(n, -1, dtype=dtype)       # the others' blocks hold junk until then
            out[bounds[t.rank]:bounds[t.rank + 1]] = blocks[t.rank]
            assert RingPlane(t).allgather(out, counts) is True
            return out

        expected = np.concatenate(blocks)
        for r, got in enumerate(run_ranks(size, work)):
            np.testing.assert_array_equal(got, expected, err_msg=f"{dtype} rank {r}")


# -- broadcast -------------------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("nbytes", [0, 13, ring.SMALL + 1, (3 << 20) + 5])
def test_broadcast_from_every_root(size, nbytes):
    data = np.random.default_rng([3, nbytes]).integers(0, 256, nbytes, dtype=np.uint8)
    for root in range(size):
        def work(t, root=root):
            buf = data.copy() if t.rank == root else np.full(nbytes, t.rank, np.uint8)
            assert RingPlane(t).broadcast(buf, root) is True
            return buf

        for r, got in enumerate(run_ranks(size, work)):
            np.testing.assert_array_equal(got, data, err_msg=f"root {root} rank {r}")


@pytest.mark.parametrize("dtype", _DTYPES)
def test_broadcast_keeps_the_dtype(dtype):
    data = np.arange(_big(dtype)).astype(dtype)

    def work(t):
        buf = data.copy() if t.rank == 1 else np.zeros_like(data)
        RingPlane(t).broadcast(buf, 1)
        return buf

    for got in run_ranks(3, work):
        np.testing.assert_array_equal(got, data)


# -- alltoall --------------------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_alltoall_uneven(size, seed):
    """counts[i][j]: elements rank i sends to rank j; zeros included, and (seed 2) large
    blocks beside empty ones."""
    rng = np.random.default_rng([4, size, seed])
    m = rng.integers(0, 5, (size, size))
    m[rng.random((size, size)) < 0.3] = 0
    if seed == 2:
        m[0, size - 1], m[size - 1, 0] = 40_000, 0
    m = m.tolist()
    for dtype in _DTYPES:
        sends = [np.arange(sum(m[i])).astype(dtype) + 1000 * i for i in range(size)]
        sb = [ring.segment_bounds(m[i]) for i in range(size)]

        def work(t, sends=sends, dtype=dtype):
            r = t.rank
            recv_counts = [m[j][r] for j in range(size)]
            recv = np.full(sum(recv_counts), -1, dtype=dtype)
            assert RingPlane(t).alltoall(sends[r], m[r], recv, recv_counts) is True
            return recv

        for r, got in enumerate(run_ranks(size, work)):
            expected = np.concatenate([sends[j][sb[j][r]:sb[j][r + 1]] for j in range(size)])
            np.testing.assert_array_equal(got, expected, err_msg=f"{dtype} rank {r}")


def test_zero_length_collectives_move_nothing():
    def work(t):
        plane = RingPlane(t)
        empty = np.empty(0, dtype=np.float32)
        counts = [0] * t.size
        return (plane.allreduce(empty, np.add), plane.reducescatter(empty, counts, np.add),
                plane.allgather(empty, counts), plane.broadcast(empty, 0),
                plane.alltoall(empty, counts, empty.copy(), counts))

    assert run_ranks(3, work) == [(True,) * 5] * 3


# -- a lost peer is an error, never a hang -----------------------------------------------------
def _outcomes(transports, fn, ranks):
    """Run ``fn(transport)`` on ``ranks``' threads; {rank: (exception or None, seconds)}."""
    got = {}

    def body(r):
        start = time.monotonic()
        try:
            fn(transports[r])
            got[r] = (None, time.monotonic() - start)
        except BaseException as e:  # the test inspects it
            got[r] = (e, time.monotonic() - start)

    threads = {r: threading.Thread(target=body, args=(r,), daemon=True) for r in ranks}
    for th in threads.values():
        th.start()
    return threads, got


def _join(threads):
    for th in threads.values():
        th.join(_JOIN_S)
    hung = [r for r, th in threads.items() if th.is_alive()]
    assert not hung, f"ranks {hung} hang"


@pytest.mark.parametrize("path", ["direct", "ring"])
def test_a_closed_peer_makes_the_others_raise_naming_it(path):
    n = 100 if path == "direct" else _big("float64")
    transports = loopback_group(3, timeout=60.0)
    threads, got = _outcomes(transports, lambda t: RingPlane(t).allreduce(
        np.ones(n), np.add), ranks=[0, 1])
    time.sleep(0.2)                                  # both are waiting for rank 2 now
    transports[2].close()
    _join(threads)
    for r in (0, 1):
        error, seconds = got[r]
        assert isinstance(error, TransportBrokenError), (r, error)
        assert error.rank == 2 and "rank 2" in str(error)
        assert seconds < 0.2 + _PROMPT_S, (r, seconds)
    for t in transports:
        t.close()


def test_a_wait_on_one_peer_notices_another_peer_closing():
    """Rank 1 waits for rank 0, which is alive and silent; rank 2 closing still ends it."""
    transports = loopback_group(3, timeout=60.0)
    threads, got = _outcomes(transports, lambda t: t.recv(0, memoryview(bytearray(8))),
                             ranks=[1])
    time.sleep(0.2)
    transports[2].close()
    _join(threads)
    error, seconds = got[1]
    assert isinstance(error, TransportBrokenError) and error.rank == 2, error
    assert seconds < 0.2 + _PROMPT_S
    for t in transports:
        t.close()


def test_closing_my_own_transport_ends_my_wait():
    transports = loopback_group(2, timeout=60.0)
    threads, got = _outcomes(transports, lambda t: t.recv(1, memoryview(bytearray(8))),
                             ranks=[0])
    time.sleep(0.2)
    transports[0].close()
    _join(threads)
    assert isinstance(got[0][0], TransportClosedError), got[0]
    with pytest.raises(TransportClosedError):
        transports[0].send(1, memoryview(b"x"))
    transports[1].close()


def test_bytes_sent_before_a_close_still_arrive():
    transports = loopback_group(2)
    transports[0].send(1, memoryview(b"last words"))
    transports[0].close()
    buf = bytearray(10)
    transports[1].recv(0, memoryview(buf))
    assert bytes(buf) == b"last words"
    with pytest.raises(TransportBrokenError, match="rank 0"):
        transports[1].recv(0, memoryview(bytearray(1)))
    transports[1].close()


def test_no_progress_times_out():
    transports = loopback_group(2, timeout=0.3)
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="no progress for 0.3 s"):
        transports[0].recv(1, memoryview(bytearray(4)))        # rank 1 never sends
    assert time.monotonic() - start < _PROMPT_S
    for t in transports:
        t.close()


def test_a_sender_blocks_while_its_peer_does_not_read():
    """Streams are bounded like a socket's buffers: a send larger than the capacity cannot
    complete before the peer reads."""
    transports = loopback_group(2, timeout=0.3, capacity=64)
    with pytest.raises(CollectiveTimeoutError):
        transports[0].send(1, memoryview(bytes(65)))
    for t in transports:
        t.close()


def test_the_policy_names_the_peer_to_blame():
    transports = loopback_group(3, timeout=60.0)
    transports[1].policy.blame = lambda peers: 0        # "the control plane says rank 0"
    transports[2].close()
    with pytest.raises(TransportBrokenError) as info:
        transports[1].recv(2, memoryview(bytearray(1)))
    assert info.value.rank == 0 and "lost ranks [2]" in str(info.value)
    for t in transports:
        t.close()


# -- watch -----------------------------------------------------------------------------------
def test_watch_returns_ready_fds_and_times_out():
    transports = loopback_group(2)
    r, w = os.pipe()
    try:
        start = time.monotonic()
        assert transports[0].watch([r], timeout=0.05) == set()
        assert time.monotonic() - start < _PROMPT_S
        os.write(w, b"!")
        assert transports[0].watch([r], timeout=5.0) == {r}
        transports[1].close()
        assert transports[0].watch([r], timeout=0.05) == {r}   # a ready fd comes first
        os.read(r, 1)
        with pytest.raises(TransportBrokenError, match="rank 1"):
            transports[0].watch([r], timeout=5.0)
    finally:
        os.close(r)
        os.close(w)
        transports[0].close()
    with pytest.raises(TransportClosedError):
        transports[0].watch(timeout=0.0)


# -- the contracts -----------------------------------------------------------------------------
def test_transports_and_planes_keep_the_contracts():
    tcp = TcpTransport(0, 1, {})
    loop = loopback_group(2)
    assert isinstance(tcp, NetworkTransport) and isinstance(tcp, Transport)
    assert isinstance(loop[0], Transport)
    assert isinstance(SubsetTransport(loop[0], [0]), Transport)
    for plane in (RingPlane, ShmGroup, Hierarchical, GlooGroup, MpiGroup):
        assert issubclass(plane, Plane), plane
    assert isinstance(RingPlane(loop[0]), Plane)
    for t in (tcp, *loop):
        t.close()


def test_views_share_the_policy():
    policy = WaitPolicy()
    tcp = TcpTransport(0, 1, {}, policy=policy)
    view = SubsetTransport(tcp, [0])
    assert tcp.policy is policy and view.policy is policy
    view.policy.spin_until, view.policy.blame = 3.0, max
    assert (tcp.policy.spin_until, tcp.policy.blame) == (3.0, max)
    assert not hasattr(tcp, "spin_until") and not hasattr(view, "blame")
    assert TcpTransport(0, 1, {}).policy is not policy            # default: a fresh one
    assert WaitPolicy().first_lost([3, 1]) == 1
    assert WaitPolicy(blame=lambda peers: None).first_lost([3, 1]) == 1
    assert WaitPolicy(blame=lambda peers: 7).first_lost([3, 1]) == 7
    tcp.close()


def test_subset_views_run_the_ring_among_their_members():
    members = [0, 2, 3]
    xs = [np.arange(_big("int32")).astype(np.int32) * (r + 1) for r in range(4)]

    def work(t):
        if t.rank not in members:
            return None
        view = SubsetTransport(t, members)
        flat = xs[t.rank].copy()
        RingPlane(view).allreduce(flat, np.add)
        return flat

    results = run_ranks(4, work)
    expected = sum(xs[r] for r in members)
    for r in members:
        np.testing.assert_array_equal(results[r], expected)
    assert results[1] is None


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_shared_memory_plane_over_loopback_barriers():
    """ShmGroup sets up over any transport.  On x86-64 its barriers then go through the
    segment's words and leave the transport alone; elsewhere they ride on the transport,
    raising its policy.spin_until for the spin budget."""
    n = 300_001
    xs = [np.arange(n, dtype=np.float64) * (r + 1) for r in range(3)]

    def work(t):
        plane = ShmGroup(t, slot_bytes=1 << 16)
        plane.spin_s = 0.001
        try:
            flat = xs[t.rank].copy()
            assert plane.allreduce(flat, np.add) is True
            assert plane.alltoall(flat, [1, 1, 1], flat, [1, 1, 1]) is False
            return flat, t.policy.spin_until
        finally:
            plane.close()

    for flat, spun in run_ranks(3, work):
        np.testing.assert_array_equal(flat, np.arange(n, dtype=np.float64) * 6)
        assert (spun == 0) if shm_words_used() else (spun > 0)


def shm_words_used():
    from hora.backends import shm
    return shm.futex.available()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
@pytest.mark.parametrize("size", [2, 3])
def test_shared_memory_barriers_many_chunks_both_sets(size):
    """Many chunks (each one barrier, the two sets in turn), then a larger buffer that
    grows the segment (its words start again from zero): every element right, every time,
    with the ranks arriving at different moments."""
    rng = np.random.default_rng(size)
    rounds = [rng.integers(-1000, 1000, (size, n)).astype(np.int64)
              for n in (5_000, 70_000, 3, 200_000, 70_001)]

    def work(t):
        plane = ShmGroup(t, slot_bytes=1 << 15)    # 4,096 int64 a chunk: up to 49 chunks
        out = []
        try:
            for k, xs in enumerate(rounds):
                if (k + t.rank) % size == 0:
                    time.sleep(0.01)               # one rank late to each barrier in turn
                flat = xs[t.rank].copy()
                assert plane.allreduce(flat, np.add) is True
                out.append(flat)
            return out
        finally:
            plane.close()

    for got in run_ranks(size, work):
        for flat, xs in zip(got, rounds):
            np.testing.assert_array_equal(flat, xs.sum(axis=0))


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_shared_memory_barrier_names_a_stalled_rank_after_the_timeout():
    """A rank that stops coming (alive, connections open) fails the others' barrier after
    the transport's timeout, naming it; before the timeout nothing fails."""
    from hora.backends.shm import ShmGroup
    transports = loopback_group(2, timeout=0.5)
    release = threading.Event()

    def work(t):
        plane = ShmGroup(t, slot_bytes=1 << 16)
        try:
            flat = np.ones(10_000)
            assert plane.allreduce(flat, np.add) is True      # the segment exists
            if t.rank == 1:
                release.wait(10)                    # rank 1 stalls, alive
                return None
            t0 = time.monotonic()
            try:
                plane.allreduce(flat, np.add)
            except CollectiveTimeoutError as e:
                return str(e), time.monotonic() - t0
            finally:
                release.set()
            return None
        finally:
            plane.close()

    results = run_ranks(2, work, transports=transports)
    message, waited = results[0]
    if shm_words_used():
        assert "waiting for ranks [1] at a shared-memory barrier" in message
    assert "0.5 s" in message
    assert 0.5 <= waited < 5


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_shared_memory_barrier_names_a_rank_that_hung_up():
    """A rank whose connections close while another waits at a barrier is named at once
    (well within a second), not after the timeout."""
    from hora.backends.shm import ShmGroup
    transports = loopback_group(2, timeout=30.0)

    def work(t):
        plane = ShmGroup(t, slot_bytes=1 << 16)
        try:
            flat = np.ones(10_000)
            assert plane.allreduce(flat, np.add) is True
            if t.rank == 1:
                time.sleep(0.05)
                t.close()                           # as if the process died
                return None
            t0 = time.monotonic()
            try:
                plane.allreduce(flat, np.add)
            except TransportBrokenError as e:
                return e.rank, time.monotonic() - t0
            return None
        finally:
            plane.close()

    results = run_ranks(2, work, transports=transports)
    rank, waited = results[0]
    assert rank == 1
    assert waited < 1.0


# -- groups larger than ring.DIRECT_MAX: small collectives keep to the ring -------------------
class _Peers:
    """A transport that records which peers it talked to."""

    def __init__(self, t):
        self._t, self.rank, self.size, self.policy = t, t.rank, t.size, t.policy
        self.used = set()

    def sendrecv(self, send_peer, send_buf, recv_peer, recv_buf, *args, **kwargs):
        self.used.update(p for p, b in ((send_peer, send_buf), (recv_peer, recv_buf))
                         if b is not None and len(b))
        return self._t.sendrecv(send_peer, send_buf, recv_peer, recv_buf, *args, **kwargs)

    def send(self, peer, buf):
        self.sendrecv(peer, buf, None, None)

    def recv(self, peer, buf, *args, **kwargs):
        self.sendrecv(None, None, peer, buf, *args, **kwargs)

    def exchange(self, sends, recvs):
        sends, recvs = list(sends), list(recvs)
        self.used.update(p for p, b in sends + recvs if len(b))
        return self._t.exchange(sends, recvs)


def test_a_large_group_keeps_small_collectives_and_votes_to_its_ring_neighbours():
    from hora.backends.segments import vote
    size = ring.DIRECT_MAX + 3
    xs = _inputs(size, 5, "float64", "sum")         # fewer elements than ranks, too
    counts = [1 + r % 3 for r in range(size)]
    blocks = [np.full(c, 10.0 * r) for r, c in enumerate(counts)]

    def work(t):
        t = _Peers(t)
        plane = RingPlane(t)
        summed = xs[t.rank].copy()
        plane.allreduce(summed, np.add)
        gathered = np.zeros(sum(counts))
        bounds = ring.segment_bounds(counts)
        gathered[bounds[t.rank]:bounds[t.rank + 1]] = blocks[t.rank]
        plane.allgather(gathered, counts)
        sent = np.arange(7.0) if t.rank == 5 else np.zeros(7)
        plane.broadcast(sent, 5)
        votes = (vote(t, True), vote(t, t.rank != 4))
        return summed, gathered, sent, votes, t.used

    for r, (summed, gathered, sent, votes, used) in enumerate(run_ranks(size, work)):
        np.testing.assert_array_equal(summed, _oracle(xs, "sum", "float64"))
        np.testing.assert_array_equal(gathered, np.concatenate(blocks))
        np.testing.assert_array_equal(sent, np.arange(7.0))
        assert votes == (True, False), r
        assert used <= {(r - 1) % size, (r + 1) % size}, (r, sorted(used))
