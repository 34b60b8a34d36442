"""One connection carrying a pair's control messages and its data (hora.backends.mux):
each side gets its own bytes in order whichever side reads first, a frame the kernel took
in part is finished before the other side sends, and the transport's waits keep watching a
shared connection.  Real sockets (a Unix stream pair), in one process."""
import random
import select
import socket
import threading
import time

import numpy as np
import pytest

from hora.backends.mux import Shared
from hora.backends.tcp import TcpTransport
from hora.core.engine.conn import Conn
from hora.core.wire import Dead, HostPost, Nudge
from hora.errors import TransportBrokenError


_OPEN = []


@pytest.fixture(autouse=True)
def _close_pairs():
    yield
    while _OPEN:
        _OPEN.pop().close()


def _pair():
    a, b = socket.socketpair()
    _OPEN.extend((a, b))
    return Shared(a), Shared(b)


def _message(i):
    """A control message of the kinds the engines send: pickled, or a packed host post;
    one in twenty spans several reads (about 100 KB, as a request with its small inputs)."""
    if i % 3 == 0:
        return HostPost(i, i * 7, b"sig%d" % i, bytes(range(i % 50)))
    if i % 3 == 1:
        return Nudge()
    return Dead(i, f"rank {i} died" * (i % 40 if i % 20 != 2 else 9_000))


def _drain_data(end, want):
    """Read ``want`` data bytes from ``end`` (non-blocking: what has arrived)."""
    got = bytearray()
    buf = memoryview(bytearray(want))
    while len(got) < want:
        try:
            n = end.recv_into(buf[:want - len(got)])
        except BlockingIOError:
            break
        assert n > 0
        got += buf[:n]
    return bytes(got)


def _send_all(shared, conn, plan, data):
    """The sender's side: each ``("msg", message)`` through the control connection ``conn``,
    each ``("data", start, end)`` of ``data`` through ``shared``'s data side."""
    for item in plan:
        if item[0] == "msg":
            conn.send(item[1])
            continue
        at, end = item[1], item[2]
        while at < end:
            try:
                at += shared.data.send(memoryview(data)[at:end])
            except BlockingIOError:
                select.select([], [shared.sock], [], 0.1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_side_gets_its_own_bytes_in_order_whoever_reads_first(seed):
    """Control messages and data chunks of many sizes, sent interleaved by one thread while
    this one reads the two sides in a random order (a chunk larger than the socket's buffer
    goes in parts): the data arrive byte for byte, the messages all and in order."""
    rng = random.Random(seed)
    left, right = _pair()
    data = np.random.default_rng(seed).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    messages = [_message(i) for i in range(300)]
    plan, at, queue = [], 0, list(messages)
    while at < len(data) or queue:
        if queue and (rng.random() < 0.5 or at == len(data)):
            plan.append(("msg", queue.pop(0)))
        else:
            n = min(rng.choice([1, 7, 4096, 70_000, 1 << 20]), len(data) - at)
            plan.append(("data", at, at + n))
            at += n
    sender = threading.Thread(target=_send_all,
                              args=(left, Conn(left.ctrl, 1, timeout=20), plan, data))
    sender.start()
    inbox = Conn(right.ctrl, 0, timeout=20)
    got_msgs, got_data = [], bytearray()
    while len(got_data) < len(data) or len(got_msgs) < len(messages):
        before = len(got_data), len(got_msgs)
        if rng.random() < 0.5:
            got_data += _drain_data(right.data, len(data) - len(got_data))
        else:
            got_msgs += inbox.receive()
        if before == (len(got_data), len(got_msgs)):
            select.select([right.sock], [], [], 0.01)
    sender.join(10)
    assert bytes(got_data) == data
    assert got_msgs == messages


@pytest.mark.timeout(10)
def test_a_data_read_keeps_control_messages_and_rings_for_them():
    """A data read that meets control frames keeps them for the control side and calls
    ``notify`` (the socket no longer shows them); a control read that meets data keeps it
    for the data side, which then needs no wait."""
    left, right = _pair()
    rung = []
    right.notify = lambda: rung.append(1)
    out, inbox = Conn(left.ctrl, 1, timeout=5), Conn(right.ctrl, 0, timeout=5)
    out.send(Nudge())
    assert left.data.send(memoryview(b"abc")) == 3
    assert _drain_data(right.data, 3) == b"abc"
    assert rung == [1]
    assert select.select([right.sock], [], [], 0)[0] == []      # read from the socket
    assert inbox.receive() == [Nudge()]
    # the other way round: data first, read by the control side
    assert left.data.send(memoryview(b"xyz")) == 3
    out.send(Nudge())
    assert inbox.receive() == [Nudge()]
    assert right.data.buffered()
    assert _drain_data(right.data, 3) == b"xyz"
    assert not right.data.buffered()


@pytest.mark.timeout(10)
def test_a_frame_in_part_holds_the_other_side_until_it_is_sent():
    """A data frame the kernel took only part of: a control send raises BlockingIOError
    (as a full socket does) until the rest of the frame is sent; the reader then gets
    the whole chunk before the message."""
    left, right = _pair()
    big = bytes(range(256)) * (1 << 14)                 # 4 MiB: more than the buffer
    first = left.data.send(memoryview(big))
    assert 0 < first < len(big)
    got = bytearray()
    while not select.select([], [left.sock], [], 0)[1]:     # room in the socket again
        got += _drain_data(right.data, 1 << 16)
    assert len(got) < first
    with pytest.raises(BlockingIOError):
        left.ctrl.send(b"\0\0\0\0")
    inbox = Conn(right.ctrl, 0, timeout=5)
    out = Conn(left.ctrl, 1, timeout=5)
    sent = first
    while len(got) < len(big):
        try:
            sent += left.data.send(memoryview(big)[sent:])
        except BlockingIOError:
            pass
        got += _drain_data(right.data, len(big) - len(got))
    out.send(Nudge())
    assert bytes(got) == big and inbox.receive() == [Nudge()]


@pytest.mark.timeout(10)
def test_each_side_sees_the_end_after_what_came_before_it():
    left, right = _pair()
    Conn(left.ctrl, 1, timeout=5).send(Nudge())
    left.data.send(memoryview(b"last"))
    left.close()
    inbox = Conn(right.ctrl, 0, timeout=5)
    assert inbox.receive() == [Nudge()]
    assert _drain_data(right.data, 4) == b"last"
    assert right.data.recv_into(memoryview(bytearray(4))) == 0
    with pytest.raises(TransportBrokenError, match="rank 0 closed its control connection"):
        inbox.receive()


@pytest.mark.timeout(10)
def test_the_transport_keeps_watching_a_connection_its_caller_also_waits_on():
    """The engine waits on its control connections through the transport's watch; where
    one carries a peer's data, the wait must leave that peer's hang-up watch in place."""
    left, right = _pair()
    t = TcpTransport(0, 2, {1: left.data}, timeout=5)
    x = np.arange(5, dtype=np.float64)
    right.data.send(memoryview(x.tobytes()))
    assert t.watch([left.fileno()], timeout=0) == {left.fileno()}
    got = np.empty_like(x)
    t.recv(1, memoryview(got).cast("B"))
    assert (got == x).all()
    assert t.watch([left.fileno()], timeout=0) == set()
    right.close()
    with pytest.raises(TransportBrokenError, match="rank 1"):
        t.watch(timeout=1)
    t.close()


@pytest.mark.timeout(10)
def test_a_frame_cut_by_a_failed_transfer_ends_with_its_real_bytes_then_last_words():
    """A transfer that fails (another peer died) leaves a data frame in part: it is sent to
    its end from the sender's own bytes, so that a control message (last words) can follow,
    and the reader gets the true data, then the message."""
    left, right = _pair()
    big = bytes(range(256)) * (1 << 14)
    first = left.data.send(memoryview(big))
    assert 0 < first < len(big)
    got = bytearray()
    reader = threading.Thread(target=lambda: got.extend(_read_all(right.data, len(big))))
    reader.start()
    assert left.data.finish(memoryview(big)[first:], time.monotonic() + 5)
    Conn(left.ctrl, 1, timeout=5).send(Dead(2, "rank 2 died"))
    reader.join(5)
    assert bytes(got) == big
    assert Conn(right.ctrl, 0, timeout=5).receive() == [Dead(2, "rank 2 died")]


def _read_all(end, want):
    got = bytearray()
    while len(got) < want:
        got += _drain_data(end, want - len(got))
        select.select([end], [], [], 0.05)
    return got
