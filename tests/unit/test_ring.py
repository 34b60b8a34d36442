"""The ring schedules of hora.backends.ring, run in-process on N threads over real sockets.

Every rank is a thread with its own :class:`~hora.backends.tcp.TcpTransport`, connected to
every other rank by a loopback TCP connection.  Results are compared with a naive numpy
oracle (gather everything, reduce), and the structure of the schedules is asserted by
recording every ``sendrecv`` and ``exchange``: above ``ring.SMALL`` bytes, ring allreduce and
allgather only ever send to ``rank + 1`` and receive from ``rank - 1``, and an allreduce sends
2(N-1)/N of the buffer per rank; at or below it, each rank sends its data straight to every
peer in one round trip.
"""
import functools
import socket

import numpy as np
import pytest

from hora.backends import ring
from hora.backends.tcp import TcpTransport

from tests.helpers import on_threads

pytestmark = pytest.mark.timeout(60)

_JOIN_S = 20.0          # per schedule; generous on a loaded 2-core CI machine
SIZES = [1, 2, 3, 4, 5, 8]


# -- test-only helpers ---------------------------------------------------------------------
def _tcp_pair(listener):
    a = socket.create_connection(listener.getsockname())
    b, _ = listener.accept()
    return a, b


class _Recorder:
    """Wraps a transport's ``sendrecv`` and ``exchange`` to log every transfer.

    ``calls`` holds ``(send_peer, send_bytes, recv_peer, recv_bytes)`` per ``sendrecv``
    (``send``/``recv`` go through it too); ``exchanges`` holds ``(sends, recvs)`` per
    ``exchange``, each a list of ``(peer, bytes)``.
    """

    def __init__(self, transport):
        self.calls, self.exchanges = [], []
        inner_sendrecv, inner_exchange = transport.sendrecv, transport.exchange

        def sendrecv(send_peer, send_buf, recv_peer, recv_buf, *args, **kwargs):
            slen = 0 if send_buf is None else len(send_buf)
            rlen = 0 if recv_buf is None else len(recv_buf)
            self.calls.append((send_peer if slen else None, slen,
                               recv_peer if rlen else None, rlen))
            return inner_sendrecv(send_peer, send_buf, recv_peer, recv_buf, *args, **kwargs)

        def exchange(sends, recvs):
            self.exchanges.append(([(p, len(b)) for p, b in sends if len(b)],
                                   [(p, len(b)) for p, b in recvs if len(b)]))
            return inner_exchange(sends, recvs)

        transport.sendrecv, transport.exchange = sendrecv, exchange

    def _sends(self):
        yield from ((peer, n) for peer, n, _, _ in self.calls if n)
        for sends, _ in self.exchanges:
            yield from sends

    def _recvs(self):
        yield from ((peer, n) for _, _, peer, n in self.calls if n)
        for _, recvs in self.exchanges:
            yield from recvs

    def sent_to(self):
        return {peer for peer, _ in self._sends()}

    def received_from(self):
        return {peer for peer, _ in self._recvs()}

    def bytes_sent(self, peer=None):
        return sum(n for p, n in self._sends() if peer is None or p == peer)

    def bytes_received(self, peer=None):
        return sum(n for p, n in self._recvs() if peer is None or p == peer)


def run_schedule(size, fn, order=None):
    """Run ``fn(transport)`` on ``size`` threads (one per rank); return (results, recorders).
    ``order``: the transports' ring (None: rank order).

    Fails the test (naming the ranks) when a thread raises or does not finish in time.
    """
    listener = socket.create_server(("127.0.0.1", 0))
    socks = [dict() for _ in range(size)]
    try:
        for i in range(size):
            for j in range(i + 1, size):
                socks[i][j], socks[j][i] = _tcp_pair(listener)
    finally:
        listener.close()
    transports = [TcpTransport(r, size, socks[r], timeout=_JOIN_S, ring=order)
                  for r in range(size)]
    recorders = [_Recorder(t) for t in transports]
    return on_threads(transports, fn, _JOIN_S), recorders


def _inputs(size, n, dtype, seed=0, kind="sum"):
    rng = np.random.default_rng([seed, size, n])
    dtype = np.dtype(dtype)
    out = []
    for _ in range(size):
        if dtype == np.bool_:
            x = rng.random(n) < (0.3 if kind == "sum" else 0.8)
        elif dtype.kind in "iu":
            x = rng.integers(0 if dtype.kind == "u" else -4, 5, n).astype(dtype)
        elif dtype.kind == "c":
            x = (rng.integers(-8, 9, n) + 1j * rng.integers(-8, 9, n)).astype(dtype)
        elif kind == "prod":
            x = rng.choice([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0], n).astype(dtype)
        else:
            x = rng.integers(-8, 9, n).astype(dtype)     # integer-valued: sums are exact
        out.append(x)
    return out


# -- pure helpers ----------------------------------------------------------------------------
@pytest.mark.parametrize("n,size", [(0, 1), (0, 4), (1, 4), (3, 4), (4, 4), (10, 4), (7, 3),
                                    (5, 8), (1 << 20, 7)])
def test_even_counts(n, size):
    counts = ring.even_counts(n, size)
    assert len(counts) == size and sum(counts) == n
    q, r = divmod(n, size)
    assert counts == [q + 1] * r + [q] * (size - r)


def test_segment_bounds():
    assert ring.segment_bounds([]) == [0]
    assert ring.segment_bounds([3, 0, 2, 0]) == [0, 3, 3, 5, 5]
    assert ring.segment_bounds(np.array([1, 2], dtype=np.int64)) == [0, 1, 3]
    assert all(isinstance(b, int) for b in ring.segment_bounds(np.array([1, 2])))


# -- allreduce -------------------------------------------------------------------------------
_UFUNC_CASES = [
    (np.add, "float64"), (np.add, "float32"), (np.add, "float16"), (np.add, "int8"),
    (np.add, "uint64"), (np.add, "complex64"), (np.add, "bool"),
    (np.minimum, "float32"), (np.minimum, "int16"), (np.minimum, "bool"),
    (np.maximum, "float64"), (np.maximum, "uint8"),
    (np.multiply, "float64"), (np.multiply, "int32"), (np.multiply, "complex128"),
    (np.multiply, "bool"),
]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("n", [0, 1, 2, 7, 1000, 40_000, 100_003])
def test_allreduce_matches_oracle(size, n):
    """Sizes on both sides of ring.SMALL: 40_000 elements take the direct path for 1-byte
    dtypes and the ring for the others; 100_003 takes the ring for every dtype here."""
    for ufunc, dtype in _UFUNC_CASES:
        if n == 100_003 and dtype not in ("float64", "int8", "complex128"):
            continue            # the big size only needs a few dtypes
        xs = _inputs(size, n, dtype, kind="prod" if ufunc is np.multiply else "sum")
        expected = functools.reduce(ufunc, xs)
        results, _ = run_schedule(
            size, lambda t: _allreduce_copy(t, xs[t.rank], ufunc))
        for r, got in enumerate(results):
            assert got.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(got, expected, err_msg=f"{ufunc.__name__} {dtype} "
                                          f"n={n} size={size} rank {r}")


def _allreduce_copy(t, x, ufunc, scratch=None):
    flat = x.copy()
    ring.allreduce(t, flat, ufunc, scratch)
    return flat


@pytest.mark.parametrize("scratch", ["exact", "too_small", "larger"])
def test_allreduce_scratch_buffer(scratch):
    size, n = 3, 1001
    xs = _inputs(size, n, "float64")
    need = -(-n // size)
    length = {"exact": need, "too_small": need - 1, "larger": 5 * need}[scratch]
    results, _ = run_schedule(size, lambda t: _allreduce_copy(
        t, xs[t.rank], np.add, np.full(length, np.nan)))
    for got in results:
        np.testing.assert_array_equal(got, functools.reduce(np.add, xs))


def _ring_sizes(item):
    """Element counts just above ring.SMALL (uneven segments) and well above it."""
    return [ring.SMALL // item + 1, 3 * ring.SMALL // item + 7, 300_001]


@pytest.mark.parametrize("size", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("n", _ring_sizes(4))
def test_allreduce_ring_topology_and_bandwidth(size, n):
    """Sends only go to rank+1, receives only come from rank-1, in 2(N-1) steps, and each
    rank sends exactly 2*total - counts[r] - counts[r+1] elements: 2(N-1)/N of the buffer."""
    xs = _inputs(size, n, "float32")
    results, recs = run_schedule(size, lambda t: _allreduce_copy(t, xs[t.rank], np.add))
    counts = ring.even_counts(n, size)
    item = np.dtype("float32").itemsize
    for r, rec in enumerate(recs):
        right, left = (r + 1) % size, (r - 1) % size
        assert rec.exchanges == [] and len(rec.calls) == 2 * (size - 1)
        assert rec.sent_to() <= {right}, f"rank {r} sent to {rec.sent_to()}"
        assert rec.received_from() <= {left}, f"rank {r} received from {rec.received_from()}"
        sent = rec.bytes_sent()
        assert sent == (2 * n - counts[r] - counts[right]) * item
        # the bandwidth bound itself, within the rounding of uneven segments
        assert abs(sent - 2 * (size - 1) / size * n * item) <= 2 * item
        # what a rank receives is what its left neighbour sent
        assert rec.bytes_received() == recs[left].bytes_sent()
    for got in results:
        np.testing.assert_array_equal(got, functools.reduce(np.add, xs))


@pytest.mark.parametrize("size", [2, 3, 5, 8])
@pytest.mark.parametrize("path", ["direct", "ring"])
def test_allreduce_same_bits_on_every_rank(size, path):
    """Float addition is not associative; every rank must still hold the identical result."""
    n = 1000 if path == "direct" else 3 * ring.SMALL // 8 + 5
    rng = np.random.default_rng([5, size])
    xs = [rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8, n) for _ in range(size)]
    results, _ = run_schedule(size, lambda t: _allreduce_copy(t, xs[t.rank], np.add))
    for r, got in enumerate(results):
        assert got.tobytes() == results[0].tobytes(), f"rank {r} differs from rank 0"
    np.testing.assert_allclose(results[0], np.sum(xs, axis=0), rtol=1e-9,
                               atol=1e-13 * np.sum(np.abs(xs), axis=0).max())


@pytest.mark.parametrize("size", [2, 3, 4, 8])
@pytest.mark.parametrize("nbytes", [1, 8 * 1000, ring.SMALL // 2])
def test_small_allreduce_takes_one_round_trip(size, nbytes):
    """At or below ring.SMALL every rank sends its whole buffer once to each peer."""
    n = nbytes // 8 or 1
    dtype = "float64" if nbytes >= 8 else "uint8"
    xs = _inputs(size, n, dtype, seed=6)
    results, recs = run_schedule(size, lambda t: _allreduce_copy(t, xs[t.rank], np.add))
    item = np.dtype(dtype).itemsize
    for r, rec in enumerate(recs):
        peers = set(range(size)) - {r}
        assert rec.calls == [] and len(rec.exchanges) == 1
        assert rec.sent_to() == peers and rec.received_from() == peers
        for p in peers:
            assert rec.bytes_sent(p) == rec.bytes_received(p) == n * item
    for got in results:
        np.testing.assert_array_equal(got, functools.reduce(np.add, xs))


# -- reduce-scatter and allgather ------------------------------------------------------------
_COUNTS = [[5], [3, 3], [0, 0], [7, 0, 2], [0, 1, 0, 4], [1, 1, 1, 1], [3, 0, 0, 0, 9],
           [2, 5, 0, 1, 3, 0, 0, 4], [70_000, 3, 0, 65_537], [0, 140_000, 1],
           [9_000, 0, 9_001, 17, 4_000, 0, 0, 11_111]]


@pytest.mark.parametrize("counts", _COUNTS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("ufunc,dtype", [(np.add, "float64"), (np.add, "int64"),
                                         (np.maximum, "int8"), (np.multiply, "complex64"),
                                         (np.minimum, "bool")])
def test_reducescatter_uneven_counts(counts, ufunc, dtype):
    size, n = len(counts), sum(counts)
    xs = _inputs(size, n, dtype, seed=1, kind="prod" if ufunc is np.multiply else "sum")
    expected = functools.reduce(ufunc, xs)
    bounds = ring.segment_bounds(counts)

    def work(t):
        flat = xs[t.rank].copy()
        ring.reducescatter(t, flat, counts, ufunc)
        return flat[bounds[t.rank]:bounds[t.rank + 1]]

    results, recs = run_schedule(size, work)
    for r, got in enumerate(results):
        np.testing.assert_array_equal(got, expected[bounds[r]:bounds[r + 1]],
                                      err_msg=f"rank {r}")
    for r, rec in enumerate(recs):
        assert rec.sent_to() <= {(r + 1) % size}
        assert rec.bytes_sent() == (n - counts[r]) * np.dtype(dtype).itemsize


@pytest.mark.parametrize("counts", _COUNTS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", ["float16", "uint8", "complex128", "bool"])
def test_allgather_uneven_counts(counts, dtype):
    size, n = len(counts), sum(counts)
    bounds = ring.segment_bounds(counts)
    full = _inputs(1, n, dtype, seed=2)[0]

    def work(t):
        out = np.zeros(n, dtype=dtype)          # others' blocks hold junk until gathered
        if dtype != "bool":
            out += 99
        lo, hi = bounds[t.rank], bounds[t.rank + 1]
        out[lo:hi] = full[lo:hi]
        ring.allgather(t, out, counts)
        return out

    results, recs = run_schedule(size, work)
    item = np.dtype(dtype).itemsize
    for r, got in enumerate(results):
        np.testing.assert_array_equal(got, full, err_msg=f"rank {r}")
    if size == 1:
        return
    for r, rec in enumerate(recs):
        right = (r + 1) % size
        if n * item > ring.SMALL:
            assert rec.exchanges == [] and len(rec.calls) == size - 1
            assert rec.sent_to() <= {right} and rec.received_from() <= {(r - 1) % size}
            # every block but the right neighbour's own passes through each rank once
            assert rec.bytes_sent() == (n - counts[right]) * item
        else:
            # direct: my block straight to every peer, each peer's block straight from it
            assert rec.calls == []
            for p in set(range(size)) - {r}:
                assert rec.bytes_sent(p) == counts[r] * item
                assert rec.bytes_received(p) == counts[p] * item


# -- broadcast -------------------------------------------------------------------------------
# the chunked pipeline (3 MiB, several chunks per link) is covered at sizes 2-5
@pytest.mark.parametrize("size,nbytes", [(s, b) for s in SIZES for b in (0, 1, 13, 40_000)]
                         + [(s, (3 << 20) + 5) for s in (2, 3, 4, 5)])
def test_broadcast_from_every_root(size, nbytes):
    data = np.random.default_rng([3, nbytes]).integers(0, 256, nbytes, dtype=np.uint8)
    for root in range(size):
        def work(t, root=root):
            buf = data.copy() if t.rank == root else np.full(nbytes, t.rank, np.uint8)
            ring.broadcast(t, buf, root)
            return buf

        results, recs = run_schedule(size, work)
        for r, got in enumerate(results):
            np.testing.assert_array_equal(got, data, err_msg=f"root {root} rank {r}")
        if size == 1 or nbytes == 0:
            continue
        for r, rec in enumerate(recs):
            pos = (r - root) % size
            assert rec.bytes_received() == (nbytes if pos else 0)
            if nbytes > ring.SMALL:
                # a chain from the root: each link carries the buffer exactly once
                assert rec.sent_to() <= {(r + 1) % size}
                assert rec.bytes_sent() == (0 if pos == size - 1 else nbytes)
                assert rec.received_from() <= ({(r - 1) % size} if pos else set())
            else:
                # direct: the root sends to every rank, the others only receive
                assert rec.bytes_sent() == (nbytes * (size - 1) if pos == 0 else 0)
                assert rec.received_from() == (set() if pos == 0 else {root})


# -- a ring other than rank order --------------------------------------------------------------
_ORDERS = [[0, 1, 4, 3, 2], [0, 1, 2, 3, 7, 6, 5, 4], [3, 0, 5, 1, 4, 2]]


@pytest.mark.parametrize("order", _ORDERS, ids=lambda o: "-".join(map(str, o)))
def test_the_schedules_walk_the_transports_ring_and_keep_blocks_in_rank_order(order):
    """With ``t.ring`` a permutation, every rank sends only to the next rank on it and
    receives only from the one before, and the results are the same as NumPy's: reduced and
    gathered blocks sit at their ranks' places, a broadcast reaches everyone from any root."""
    size = len(order)
    nxt = {order[i]: order[(i + 1) % size] for i in range(size)}
    prev = {b: a for a, b in nxt.items()}
    n = _ring_sizes(8)[1]
    xs = _inputs(size, n, "float64", seed=4)
    counts = [(n // size) + 3 * r - 7 for r in range(size)]
    counts[-1] += n - sum(counts)
    bounds = ring.segment_bounds(counts)
    full = _inputs(1, n, "float64", seed=5)[0]
    root = order[2]

    def work(t):
        summed = _allreduce_copy(t, xs[t.rank], np.add)
        scattered = xs[t.rank].copy()
        ring.reducescatter(t, scattered, counts, np.add)
        gathered = np.full(n, -1.0)
        lo, hi = bounds[t.rank], bounds[t.rank + 1]
        gathered[lo:hi] = full[lo:hi]
        ring.allgather(t, gathered, counts)
        sent = full.copy() if t.rank == root else np.zeros(n)
        ring.broadcast(t, sent, root)
        return summed, scattered[lo:hi], gathered, sent

    results, recs = run_schedule(size, work, order)
    expected = functools.reduce(np.add, xs)
    for r, (summed, scattered, gathered, sent) in enumerate(results):
        np.testing.assert_array_equal(summed, expected, err_msg=f"rank {r}")
        np.testing.assert_array_equal(scattered, expected[bounds[r]:bounds[r + 1]],
                                      err_msg=f"rank {r}")
        np.testing.assert_array_equal(gathered, full, err_msg=f"rank {r}")
        np.testing.assert_array_equal(sent, full, err_msg=f"rank {r}")
    for r, rec in enumerate(recs):
        assert rec.exchanges == []
        assert rec.sent_to() <= {nxt[r]}, (r, rec.sent_to())
        assert rec.received_from() <= {prev[r]}, (r, rec.received_from())


def test_broadcast_pipelines_large_buffers():
    """A middle rank forwards chunks while later chunks still arrive (many sendrecv calls,
    each sending and receiving), instead of store-and-forward of the whole buffer."""
    nbytes = (5 << 20) + 3
    data = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)
    results, recs = run_schedule(3, lambda t: _bcast(t, data, 0))
    for got in results:
        np.testing.assert_array_equal(got, data)
    middle = recs[1].calls
    assert recs[1].exchanges == [] and len(middle) > 2
    assert sum(1 for s, sn, rv, rn in middle if sn and rn) >= len(middle) - 2
    assert max(sn for _, sn, _, _ in middle) < nbytes


def _bcast(t, data, root):
    buf = data.copy() if t.rank == root else np.zeros_like(data)
    ring.broadcast(t, buf, root)
    return buf


# -- alltoall --------------------------------------------------------------------------------
def _split_matrix(size, seed):
    """counts[i][j]: elements rank i sends to rank j (zeros included)."""
    rng = np.random.default_rng([4, size, seed])
    m = rng.integers(0, 4, (size, size))
    m[rng.random((size, size)) < 0.25] = 0
    return m.tolist()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype", ["float64", "int16", "bool"])
def test_alltoall_uneven(size, seed, dtype):
    m = _split_matrix(size, seed)
    if seed == 2:
        m = [[0] * size for _ in range(size)]          # nothing at all to exchange
        m[0][size - 1] = 3
    sends = [_inputs(1, sum(m[i]), dtype, seed=10 + i)[0] for i in range(size)]
    sb = [ring.segment_bounds(m[i]) for i in range(size)]

    def work(t):
        r = t.rank
        recv_counts = [m[j][r] for j in range(size)]
        recv = np.zeros(sum(recv_counts), dtype=dtype)
        ring.alltoall(t, sends[r], m[r], recv, recv_counts)
        return recv

    results, recs = run_schedule(size, work)
    item = np.dtype(dtype).itemsize
    for r, got in enumerate(results):
        expected = np.concatenate([sends[j][sb[j][r]:sb[j][r + 1]] for j in range(size)])
        np.testing.assert_array_equal(got, expected.astype(dtype), err_msg=f"rank {r}")
    for r, rec in enumerate(recs):
        # pairwise exchange: one step per other rank, my block for j goes straight to j
        assert len(rec.calls) == size - 1
        assert rec.bytes_sent() == (sum(m[r]) - m[r][r]) * item
        for s, (dst, sn, src, rn) in enumerate(rec.calls, start=1):
            assert sn == m[r][(r + s) % size] * item and (not sn or dst == (r + s) % size)
            assert rn == m[(r - s) % size][r] * item and (not rn or src == (r - s) % size)


def test_schedules_on_one_rank_do_not_touch_the_transport():
    x = np.arange(6.0)
    results, recs = run_schedule(1, lambda t: (
        _allreduce_copy(t, x, np.add), _bcast(t, x, 0), _gather_self(t, x)))
    (a, b, c), = results
    np.testing.assert_array_equal(a, x)
    np.testing.assert_array_equal(b, x)
    np.testing.assert_array_equal(c, x)
    assert recs[0].calls == [] and recs[0].exchanges == []


def _gather_self(t, x):
    out = x.copy()
    ring.allgather(t, out, [x.size])
    send = x.copy()
    recv = np.empty_like(x)
    ring.alltoall(t, send, [x.size], recv, [x.size])
    np.testing.assert_array_equal(recv, x)
    return out
