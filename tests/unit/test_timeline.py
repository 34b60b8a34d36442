"""The timeline's pieces in one process: the writer's file (complete, or cut short), its
bound, the summary's numbers, and the clock offset measured over a socket."""
import json
import select
import socket
import threading
import time

import numpy as np
import pytest

from hora.core import timeline
from hora.core.bootstrap import Ctrl
from hora.core.topology import Topology


def test_writer_file_is_valid_json_cut_short_or_closed(tmp_path):
    path = tmp_path / "sub" / "t.json"
    w = timeline.Writer(str(path), 2, origin=100.0)
    w.write(1, [("grad", "QUEUE", 100.5, 0.001, None),
                ("grad", "ALLREDUCE shm", 100.6, 0.002, {"bytes": 8}),
                (None, "CYCLE", 100.7, -1.0, None)])
    deadline = time.monotonic() + 5
    while "CYCLE" not in path.read_text() and time.monotonic() < deadline:
        time.sleep(0.01)
    cut = path.read_text()                      # what a crash now would leave
    assert not cut.rstrip().endswith("]")
    events = timeline.load(str(path))
    assert json.loads(cut + "]") == events
    w.close()
    closed = json.loads(path.read_text())
    assert closed == events
    spans = [e for e in closed if e["ph"] == "X"]
    assert [(e["name"], e["pid"], e["ts"], e["dur"]) for e in spans] == [
        ("QUEUE", 1, 500000.0, 1000.0), ("ALLREDUCE shm", 1, 600000.0, 2000.0)]
    assert spans[0]["tid"] == spans[1]["tid"]            # one row per tensor
    rows = [e for e in closed if e["name"] == "thread_name"]
    assert [(r["pid"], r["tid"], r["args"]["name"]) for r in rows] == [(1, spans[0]["tid"],
                                                                         "grad")]
    (cycle,) = [e for e in closed if e["ph"] == "i"]
    assert (cycle["name"], cycle["ts"]) == ("CYCLE", 700000.0)


def test_each_event_is_written_as_the_json_of_its_fields(tmp_path):
    """Spans are written from cached pieces (a board round every few microseconds): the
    file says what json.dumps of each event's fields says, whatever the names and args."""
    shared = {"bytes": 4}
    events = [("loss", "ALLREDUCE board", 100.0 + i * 1e-6, 3.25e-6, shared) for i in range(3)]
    events += [('we"ird \u00e9\n', "BARRIER", 100.5, 0.0, None),
               ("loss", "QUEUE", 100.25, 1e-7, {"bytes": 8, "fused": 2}),
               (None, "CYCLE", 101.0, -1.0, {"n": 1}),
               ("grad", "NEGOTIATION", 99.0, 0.5, {"arrived_ms": {"1": 0.5}, "last": 1})]
    w = timeline.Writer(str(tmp_path / "t.json"), 2, origin=99.5)
    w.write(1, events)
    w.close()
    written = json.loads((tmp_path / "t.json").read_text())
    tids = {e["args"]["name"]: e["tid"] for e in written if e["name"] == "thread_name"}
    got = [e for e in written if e["ph"] in ("X", "i")]
    want = []
    for row, phase, start, dur, args in events:
        e = {"name": phase, "pid": 1, "ts": round((start - 99.5) * 1e6, 3)}
        if dur < 0:
            e.update(ph="i", s="t", tid=0)
        else:
            e.update(ph="X", dur=round(dur * 1e6, 3), tid=tids[row])
        if args:
            e["args"] = args
        want.append(e)
    assert got == want
    assert len(set(tids.values())) == 3


def test_rounds_travel_in_batches_and_are_written_as_one_span_each(tmp_path):
    """A lane's rounds (Recorder.rounds) are taken as batches of at most 256 of one kind,
    moved to rank 0's clock, and written as the spans span() would have given."""
    rec = timeline.Recorder(1, offset=10.0)
    loss = ("lo%ss", "ALLREDUCE board", {"bytes": 4})       # (a % in a name)
    grad = ("grad", "ALLREDUCE board", {"bytes": 64})
    rounds = [(loss if i < 300 or i >= 310 else grad, 1.0 + i * 1e-3, 1.0 + i * 1e-3 + 5e-6)
              for i in range(400)]
    lists = {id(loss): rec.rounds(loss), id(grad): rec.rounds(grad)}
    for what, start, end in rounds:
        lists[id(what)] += (start, end)
    rec.span("w", "BROADCAST board", 2.0, 2.5, {"bytes": 8})
    taken = rec.take()
    assert rec.take() == []
    batches = [e for e in taken if e[2] is None]
    assert [(e[0], len(e[3]) // 16) for e in batches] == [
        ("lo%ss", 256), ("lo%ss", 134), ("grad", 10)]
    w = timeline.Writer(str(tmp_path / "t.json"), 2, origin=10.5)
    w.write(1, taken)
    w.close()
    written = json.loads((tmp_path / "t.json").read_text())
    rows = {e["tid"]: e["args"]["name"] for e in written if e["name"] == "thread_name"}
    got = sorted((rows[e["tid"]], e["ts"], e["dur"], e["args"]["bytes"]) for e in written
                 if e["ph"] == "X" and e["name"] == "ALLREDUCE board")
    want = sorted((row, round((start + 10.0 - 10.5) * 1e6, 3), round((end - start) * 1e6, 3),
                   args["bytes"]) for (row, _, args), start, end in rounds)
    assert got == want
    (b,) = [e for e in written if e["name"] == "BROADCAST board"]
    assert (rows[b["tid"]], b["ts"], b["dur"]) == ("w", 1500000.0, 500000.0)


def test_spans_recorded_while_they_are_taken_are_never_lost():
    """A board call appends its round from the caller's thread, with no lock, while the
    engine's thread takes the events to send them: each span is taken exactly once."""
    rec = timeline.Recorder(1, 0.0)
    n = 100000
    times = rec.rounds(("x", "ALLREDUCE board", None))

    def record():
        nonlocal times
        for i in range(n):
            rec.span("x", "QUEUE", float(i), float(i))
            times += (float(i), i + 0.5)
    writer = threading.Thread(target=record)
    taken = []
    writer.start()
    while writer.is_alive():
        taken += rec.take()
    writer.join()
    taken += rec.take()
    assert [e[2] for e in taken if e[2] is not None] == [float(i) for i in range(n)]
    pairs = np.frombuffer(b"".join(e[3] for e in taken if e[2] is None)).reshape(-1, 2)
    assert pairs[:, 0].tolist() == [float(i) for i in range(n)]
    assert (pairs[:, 1] == 0.5).all()


def test_writer_drops_and_counts_what_it_cannot_keep(tmp_path):
    w = timeline.Writer(str(tmp_path / "t.json"), 1, origin=0.0, limit=256)
    gate = threading.Event()
    original = w._put
    w._put = lambda text: (gate.wait(5), original(text))     # a slow disk
    events = [("x", "QUEUE", float(i), 0.0, None) for i in range(256)]
    for _ in range(4):
        w.write(0, events)
    gate.set()
    w.close()
    assert w.dropped >= 256                    # one batch queued, one being written at most
    kept = [e for e in json.loads((tmp_path / "t.json").read_text()) if e.get("ph") == "X"]
    assert len(kept) + w.dropped == 4 * 256


def test_summary_counts_means_p99_bytes_and_the_last_rank():
    events = [{"ph": "M", "name": "thread_name", "pid": r, "tid": 1, "args": {"name": "g"}}
              for r in range(2)]
    durs = {0: [1.0, 2.0, 3.0], 1: [10.0, 20.0, 30.0]}
    for r, ds in durs.items():
        for d in ds:
            events.append({"ph": "X", "name": "ALLREDUCE tcp", "pid": r, "tid": 1,
                           "ts": 0, "dur": d * 1000, "args": {"bytes": 100}})
    events += [{"ph": "X", "name": "NEGOTIATION", "pid": 0, "tid": 1, "ts": 0, "dur": 1,
                "args": {"last": last, "arrived_ms": {}}} for last in (1, 1, 0)]
    rows, last, per_rank = timeline.summarize(events)
    (row,) = rows
    values = sorted(d for ds in durs.values() for d in ds)
    assert row[:3] == ("g", "ALLREDUCE tcp", 6)
    assert row[3] == pytest.approx(sum(values) / 6) and row[4] == 30.0
    assert row[5] == 600
    assert last == {1: 2, 0: 1}
    assert per_rank == {(0, "COLLECTIVE"): 6.0, (1, "COLLECTIVE"): 60.0}


def test_clock_offset_of_a_remote_host_is_measured_by_its_leader_and_told_to_its_ranks():
    """Rank 0 on host-a; ranks 1 and 2 on host-b, whose leader (1) measures its clock's
    offset to rank 0's and tells rank 2, whose control connection comes to it."""
    a, b = socket.socketpair()          # rank 0 <-> rank 1
    c, d = socket.socketpair()          # rank 1 <-> rank 2
    hosts = ("host-a", "host-b", "host-b")
    topo = [Topology(r, 3, [0, 0, 1][r], [1, 2, 2][r], [0, 1, 1][r], 2, False, hosts)
            for r in range(3)]
    skew = 12.345
    got = {}

    def rank(r, ctrl):
        got[r] = timeline.measure_offsets(r, topo[r], ctrl, 5.0,
                                          clock=lambda: time.monotonic() + skew)
    threads = [threading.Thread(target=rank, args=(1, Ctrl(0, b, {2: c}))),
               threading.Thread(target=rank, args=(2, Ctrl(1, d, {})))]
    try:
        for t in threads:
            t.start()
        assert timeline.measure_offsets(0, topo[0], Ctrl(None, None, {1: a}), 5.0) == 0.0
        for t in threads:
            t.join(5)
        assert got[1] == pytest.approx(-skew, abs=1e-3)
        assert got[2] == got[1]
        # ranks on rank 0's host share its clock: nothing is exchanged
        same = Topology(1, 2, 1, 2, 0, 1, True, ("h", "h"))
        assert timeline.measure_offsets(1, same, Ctrl(0, None, {}), 5.0) == 0.0
    finally:
        timeline.clock_offset = 0.0     # (the threads share this process's)
        for s in (a, b, c, d):
            s.close()


def test_clock_offsets_over_connections_that_carry_data_leave_them_framed_and_waiting():
    """A control connection that carries its pair's data too (hora.backends.mux): the
    offsets' round trips go on the socket itself, before any frame; the data and control
    messages sent after them arrive intact, and neither end is left blocking."""
    from hora.backends.mux import Shared
    from hora.core.engine.conn import Conn
    from hora.core.wire import Nudge
    a, b = (Shared(s) for s in socket.socketpair())      # rank 0 <-> rank 1, its leader
    hosts = ("host-a", "host-b")
    topo = [Topology(r, 2, 0, 1, r, 2, False, hosts) for r in range(2)]
    got = {}
    rank1 = threading.Thread(target=lambda: got.setdefault(1, timeline.measure_offsets(
        1, topo[1], Ctrl(0, b.ctrl, {}), 5.0, clock=lambda: time.monotonic() + 7.0)))
    try:
        rank1.start()
        assert timeline.measure_offsets(0, topo[0], Ctrl(None, None, {1: a.ctrl}), 5.0) == 0
        rank1.join(5)
        assert got[1] == pytest.approx(-7.0, abs=1e-3)
        assert a.sock.gettimeout() == b.sock.gettimeout() == 0.0
        assert a.data.send(memoryview(b"offsets")) == 7
        Conn(a.ctrl, 1, 5).send(Nudge())
        inbox, msgs = Conn(b.ctrl, 0, 5), []
        while not msgs and select.select([b.sock], [], [], 5)[0]:
            msgs = inbox.receive()
        assert msgs == [Nudge()]
        buf = bytearray(7)
        assert b.data.recv_into(memoryview(buf)) == 7 and bytes(buf) == b"offsets"
    finally:
        timeline.clock_offset = 0.0
        a.close()
        b.close()


def test_in_a_tree_of_leaders_a_leader_s_offset_is_its_parent_s_plus_its_own():
    """Hosts a (rank 0), b (rank 1, a leader below rank 0) and c (ranks 2, 3: leader 2
    below leader 1, HORA_CONTROL_FANOUT=1): each host's clock skewed its own way."""
    pairs = [socket.socketpair() for _ in range(3)]     # 0-1, 1-2, 2-3
    hosts = ("a", "b", "c", "c")
    topo = [Topology(r, 4, [0, 0, 0, 1][r], [1, 1, 2, 2][r], [0, 1, 2, 2][r], 3, False, hosts)
            for r in range(4)]
    skews = [0.0, 7.5, -3.25, -3.25]
    ctrls = [Ctrl(None, None, {1: pairs[0][0]}), Ctrl(0, pairs[0][1], {2: pairs[1][0]}),
             Ctrl(1, pairs[1][1], {3: pairs[2][0]}), Ctrl(2, pairs[2][1], {})]
    got = {}

    def rank(r):
        got[r] = timeline.measure_offsets(r, topo[r], ctrls[r], 5.0,
                                          clock=lambda: time.monotonic() + skews[r])
    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 2, 3)]
    try:
        for t in threads:
            t.start()
        rank(0)
        for t in threads:
            t.join(5)
        assert got[0] == 0.0
        for r in (1, 2, 3):
            assert got[r] == pytest.approx(-skews[r], abs=2e-3), (r, got)
    finally:
        timeline.clock_offset = 0.0
        for pair in pairs:
            for s in pair:
                s.close()
