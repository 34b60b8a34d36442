"""The control plane's messages (hora.core.wire) through the engine's framing and both of its
decoders: each arrives as the typed message it was, its fields read by name."""
import pickle
import pickletools
import socket

import numpy as np
import pytest

from hora.core import wire
from hora.core.engine.conn import _PLAIN, Conn, frame
from hora.core.messages import ADD_SET, ALLREDUCE, ALLTOALL, JOIN, Request, Sum
from hora.core.negotiation import Coordinator
from hora.errors import TransportBrokenError


def ar(name):
    return Request(name, ALLREDUCE, "<f4", ((4,),), Sum, -1, 1.0, 1.0, None)


RESPONSES = [wire.Run(ALLREDUCE, 0, ("a", "b")),
             wire.Run(ALLTOALL, 1, ("t",), ((1, 2), (2, 2))),
             wire.Run(ALLREDUCE, 0, ("j",), wire.Joined((2,), ar("j"))),
             wire.Run(ADD_SET, 0, ("ps",), wire.NewSet(3, (0, 2))),
             wire.Run(JOIN, 0, ("join",), 1),
             wire.Error(0, ("m",), "Mismatched shapes", "aborted", {1: "TypeError: x"}),
             wire.Value(0, ("v",), (b"\0\0\x80?",)),
             wire.Cache(4, ar("c")),
             wire.Tune(2.5),
             wire.Shutdown()]
MESSAGES = [wire.Req([ar("a")], {(0, "a"): b"1234"}, [3], True),
            wire.Accept(7, [], {}, [1, 2]),
            wire.Bye(),
            wire.Stack(5, "File x, line 1"),
            wire.Resp(RESPONSES),
            wire.Offer(2, 9, (0, 1), tuple(RESPONSES[:1])),
            wire.StackQuestion(5),
            wire.Abort("stalled"),
            wire.Dead(3, "rank 3 closed its control connection"),
            wire.Nudge(),
            wire.HostPost(2, 4, b"('g', 1)", b"\0\0\x80?"),
            wire.HostPost(0, 5, b"", b"")]                      # rank 0 vetoes round 5


PICKLED = [m for m in MESSAGES if type(m) is not wire.HostPost]     # (host posts: packed)


@pytest.fixture
def pair():
    """Two connected sockets, closed after the test."""
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def _unframe(data):
    assert int.from_bytes(data[:4], "big") == len(data) - 4
    return data[4:]


@pytest.mark.parametrize("loads", [pickle.loads, _PLAIN], ids=["pickle", "restricted"])
@pytest.mark.parametrize("msg", PICKLED, ids=lambda m: m.tag)
def test_every_message_arrives_as_it_was_sent(msg, loads):
    got = wire.decode(loads(_unframe(frame(msg))))
    assert got == msg and type(got) is type(msg)
    if isinstance(msg, (wire.Resp, wire.Offer)):
        assert [type(r) for r in got.responses] == [type(r) for r in msg.responses]


def test_a_message_is_the_tuple_that_travels_tag_first():
    assert wire.Run(ALLREDUCE, 0, ("a",)) == ("run", ALLREDUCE, 0, ("a",), None)
    assert wire.Dead(1, "x") == ("dead", 1, "x") and wire.Bye() == ("bye",)
    tag, kind, set_id, names, extra = wire.Run(ADD_SET, 0, ("ps",), wire.NewSet(1, (0,)))
    assert (tag, kind, extra.set_id, extra.ranks) == ("run", ADD_SET, 1, (0,))


def _class_lookups(data):
    return [op.name for op, _, _ in pickletools.genops(data)
            if op.name in ("GLOBAL", "STACK_GLOBAL")]


def test_the_steady_state_messages_name_no_class():
    # a cached small allreduce: the request, and the answer with its value
    for msg in (wire.Req([], {(0, "x"): b"1234"}, [0], False),
                wire.Resp([wire.Value(0, ("x",), (b"5678",))]),
                wire.Resp([wire.Run(ALLREDUCE, 0, ("x",))]),
                wire.Offer(1, 0, (0,), (wire.Run(ALLREDUCE, 0, ("x",)),))):
        assert _class_lookups(_unframe(frame(msg))) == []
    # a request travels as its class (the first time only: then it is cached)
    assert _class_lookups(_unframe(frame(wire.Req([ar("x")], {}, [], False)))) != []


def test_the_coordinators_responses_pass_the_restricted_decoder():
    c = Coordinator(2)
    for rank in (0, 1):
        c.submit(rank, [Request("ps", ADD_SET, "", ((0, 1),), -1, -1, 1.0, 1.0, None)],
                 now=0)
    c.submit(1, [Request("j", JOIN, "", ((),), -1, -1, 1.0, 1.0, None)], now=0)
    c.submit(0, [ar("g")], now=0)                  # rank 1 has joined: it adds zeros
    responses = c.take_responses()
    assert [type(r.extra) for r in responses] == [wire.NewSet, wire.Joined]
    msg = wire.Resp(responses)
    assert wire.decode(_PLAIN(_unframe(frame(msg)))) == msg


def test_the_restricted_decoder_refuses_a_class_outside_the_list():
    from hora.rendezvous.safepickle import PayloadRefusedError
    data = pickle.dumps(("resp", [("value", 0, ("x",), (np.float32(1),))]))
    with pytest.raises(PayloadRefusedError):
        _PLAIN(pickle.dumps(("abort", socket.socket)))
    assert wire.decode(_PLAIN(data)).responses[0].results == (np.float32(1),)


@pytest.mark.parametrize("obj", [("hello",), ("dead", 1), ("resp", [("run", 0)]),
                                 ("resp", [("nope",)]), (), "req", ["bye"]])
def test_what_is_not_a_message_is_refused(obj):
    with pytest.raises(ValueError, match="not a control message"):
        wire.decode(obj)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("plain_only", [False, True])
def test_a_connection_delivers_messages_in_order_and_refuses_a_malformed_one(plain_only, pair):
    a, b = pair
    send, recv = Conn(a, 0, timeout=5.0), Conn(b, 1, timeout=5.0, plain_only=plain_only)
    for msg in MESSAGES:
        send.send(msg)
    got = []
    while len(got) < len(MESSAGES):
        got += recv.receive()
    assert got == MESSAGES and [type(m) for m in got] == [type(m) for m in MESSAGES]
    payload = pickle.dumps(("dead", 1))                   # a field short
    a.sendall(len(payload).to_bytes(4, "big") + payload)
    with pytest.raises(TransportBrokenError, match="rank 1 sent a control message"):
        for _ in range(100):
            recv.receive()


def test_a_host_post_travels_packed_without_pickle():
    data = frame(wire.HostPost(2, -4, b"('g', 1)", b"\0\0\x80?"))
    length = int.from_bytes(data[:4], "big")
    assert length & (1 << 31) and length ^ (1 << 31) == len(data) - 4
    assert data.endswith(b"('g', 1)\0\0\x80?") and b"hpost" not in data


@pytest.mark.timeout(30)
@pytest.mark.parametrize("junk", [b"\x80\x00\x00\x02ab",      # shorter than its fields
                                  b"\x80\x00\x00\x0e" + bytes(12) + b"\x00\x09"])  # sig past the end
def test_a_malformed_host_post_breaks_the_connection(junk, pair):
    a, b = pair
    recv = Conn(b, 1, timeout=5.0, plain_only=True)
    a.sendall(junk)
    with pytest.raises(TransportBrokenError, match="rank 1 sent a malformed host post"):
        for _ in range(100):
            recv.receive()


@pytest.mark.timeout(30)
def test_messages_held_back_come_first_and_in_order(pair):
    # a leader waiting in a host round takes the host posts and holds the rest back for
    # the engine's next step (WorkerSide.hear_rounds): nothing is lost or reordered
    from hora.core.engine.worker import WorkerSide
    a, b = pair
    send, side = Conn(a, 1, timeout=5.0), WorkerSide(Conn(b, 0, timeout=5.0), None)
    first = [wire.StackQuestion(1), wire.HostPost(0, 3, b"s", b"1234"), wire.Abort("x"),
             wire.HostPost(2, 3, b"", b"")]
    for msg in first:
        send.send(msg)
    held = False
    while len(side.host_msgs) < 2:
        held |= side.hear_rounds()
    assert side.host_msgs == {(0, 3): first[1], (2, 3): first[3]} and held
    send.send(wire.Nudge())
    got = []
    while len(got) < 3:
        got += side.conn.receive()
    assert got == [first[0], first[2], wire.Nudge()]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("last", [wire.Abort("collectives stalled"), wire.Dead(2, "rank 2 died")])
def test_naming_the_first_dead_rank_leaves_every_message_for_the_engine(last, pair):
    # a rank that sees its peers hang up asks which died first (first_dead); rank 0's last
    # words before it closed (an Abort, a Dead) must still be there for the engine, which
    # names the failure by them (Engine._crashed), and the close is still seen after them
    import time
    from hora.core.engine.conn import first_dead, heard
    a, b = pair
    send, recv = Conn(a, 1, timeout=5.0), Conn(b, 0, timeout=5.0)
    said = [wire.StackQuestion(1), last]
    for msg in said:
        send.send(msg)
    a.shutdown(socket.SHUT_WR)          # rank 0 hangs up after its last words
    dead = 2 if last.__class__ is wire.Dead else 0  # no Dead: rank 0 itself is gone
    assert first_dead([recv], time.monotonic, parent=0, wait_s=0.05) == dead
    assert heard([recv]) == said
    assert recv.receive() == said
    with pytest.raises(TransportBrokenError, match="closed its control connection"):
        recv.receive()
