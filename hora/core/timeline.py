"""The timeline: a Chrome trace (JSON; opens in Perfetto and ``chrome://tracing``) of every
rank's collectives, on one clock.

Turned on by ``HORA_TIMELINE=FILE`` (or ``HOROVOD_TIMELINE``, ``hora run
--timeline-filename FILE``) at ``init()``, or by ``start_timeline(FILE, mark_cycles)`` on
every rank while the job runs; ``stop_timeline()`` ends it, and so does ``shutdown()``.

Every rank records, for each collective, the phases Horovod's timeline shows:

- ``QUEUE``: from the call until the engine sends the request to rank 0;
- ``NEGOTIATE``: until rank 0's answer arrives (on rank 0, a ``NEGOTIATION`` span says when
  each rank's request arrived and which rank came last: ``args.arrived_ms``, ``args.last``);
- ``PACK``: copying into the fusion buffer (and the prescale);
- the collective itself on its data plane (``ALLREDUCE shm``, ``ALLGATHER tcp``, ...; an
  allreduce of at most 8 KiB that rank 0 reduced with its answer: ``ALLREDUCE rank 0``, the
  copy of the result out; a barrier, a join, a process set's change: ``BARRIER`` and so on,
  an instant's span when rank 0's answer came);
- ``UNPACK``: the postscale and the copy back out;

and, with ``mark_cycles``, an instant ``CYCLE`` each time its engine sent requests.  Beyond
Horovod's timeline (rank 0's view only), each rank has a track of its own (a Chrome
"process" per rank, a row per tensor), and every event is on rank 0's clock: ranks on other
hosts measure their clock's offset to rank 0's at ``init()`` (:func:`measure_offsets`).

A collective that the shared-memory board settles (a blocking one of a one-host job, or of
each host's board) takes none of the engine's steps, and the board settles it whether or
not the timeline records: it is one span, its round, from the call to its result
(``ALLREDUCE board``, ``BARRIER board``, ``BROADCAST board``, ``ALLGATHER board``).  A
lane's rounds (a blocking allreduce that a loop repeats) go into a list of their own, two
floats a round (:meth:`Recorder.rounds`), and travel and are written in batches: a round
costs its call two clock reads and a list's extend.

Workers send their events to rank 0 on the control connection about twice a second
(:class:`~hora.core.wire.Trace`); rank 0's :class:`Writer` writes them from a thread of its
own, buffered and bounded (events beyond ``HORA_TIMELINE_MAX_EVENTS`` waiting to be written
are dropped and counted).  The file is a JSON array whose closing bracket is written last:
a crash leaves a file that Chrome's and Perfetto's loaders (and :func:`load`) still read.

With the timeline off, the engine's only cost is a test of a module global per step (and
per board call).

Layer: core.
"""
import collections
import json
import logging
import math
import os
import queue
import struct
import threading
import time

import numpy as np

from .. import config
from .messages import KIND_NAMES
from ..rendezvous.protocol import recv_exact

__all__ = ["Recorder", "Writer", "active", "board_span", "start", "stop", "load", "summarize",
           "measure_offsets", "PHASES"]

log = logging.getLogger(__name__)

PHASES = ("QUEUE", "NEGOTIATE", "PACK", "COLLECTIVE", "UNPACK")
_SHIP_S = 0.5                   # a worker sends its events to rank 0 this often
_MAX_UNSENT = 20000             # ... or when this many wait
_PINGS = 5                      # clock offset: round trips per remote rank, the best kept
_F64 = struct.Struct("!d")
_BATCH = 256                    # events a batch (of rounds, of the writer's queue) holds
_JSON = json.JSONEncoder(separators=(",", ":"))

_recorder = None                # this process's Recorder while a timeline runs
clock_offset = 0.0              # add to this rank's time.monotonic() to get rank 0's


def board_span(rec, req, started, nbytes):
    """Record on ``rec`` (None when the timeline is off) that the board settled ``req``, a
    call made at ``started``: one span, ``<KIND> board``."""
    if rec is not None:
        rec.span(req.name, f"{KIND_NAMES[req.kind].upper()} board", started, time.monotonic(),
                 {"bytes": int(nbytes)})


def active():
    """This rank's :class:`Recorder`, or None (the timeline is off)."""
    return _recorder


class Recorder:
    """One rank's events, on rank 0's clock, until they are taken (:meth:`take`).

    Attributes:
        mark_cycles: record an instant ``CYCLE`` each time the engine sends requests.
    """

    def __init__(self, rank, offset, mark_cycles=False):
        self.rank = rank
        self.offset = offset
        self.mark_cycles = mark_cycles
        # appended to by any thread without a lock (a board call records each round);
        # take() removes what it read, never swaps them, so no append is lost
        self._events = []
        self._rounds = []           # (what, its list of rounds): rounds()
        self._lock = threading.Lock()   # one take() at a time
        self.submitted = {}         # (set, name) -> time of the call
        self.sent = {}              # (set, name) -> time the request went to rank 0
        self._shipped = time.monotonic()

    def span(self, row, phase, start, end, args=None):
        """A complete event ``phase`` of ``row`` (a tensor's name) from ``start`` to ``end``
        (this rank's monotonic seconds)."""
        self._events.append((row, phase, start + self.offset, max(0.0, end - start), args))

    def rounds(self, what):
        """A list for the rounds of one lane of the board: its caller extends it by each
        round's ``(start, end)`` (this rank's monotonic seconds) in one step; ``what`` is
        their ``(row, phase, args)``.  Two floats a round, no call and no container (which
        the garbage collector would scan again and again until the events are taken): a
        round costs its lane the two clock reads and a list's extend."""
        times = []
        self._rounds.append((what, times))
        return times

    def instant(self, phase, when, args=None):
        self._events.append((None, phase, when + self.offset, -1.0, args))

    def queued(self, key, now):
        """Request ``key`` went to rank 0 at ``now``: its QUEUE span ends."""
        start = self.submitted.pop(key, None)
        if start is not None:
            self.span(key[1], "QUEUE", start, now)
        self.sent[key] = now

    def answered(self, key, now):
        """Rank 0's answer for ``key`` arrived at ``now``: its NEGOTIATE span ends."""
        start = self.sent.pop(key, None)
        if start is not None:
            self.span(key[1], "NEGOTIATE", start, now)

    def due(self):
        """A worker: time (or room) to send the events to rank 0."""
        waiting = len(self._events) + sum(len(t) for _, t in self._rounds) // 2
        return waiting and (waiting >= _MAX_UNSENT
                            or time.monotonic() - self._shipped >= _SHIP_S)

    def take(self):
        """The events recorded since the last call, as plain tuples ``(row, phase, start,
        duration, args)`` on rank 0's clock; the rounds as batches ``(row, phase, None,
        times, args)``, ``times`` the bytes of float64 pairs (start, duration), at most
        _BATCH a batch."""
        with self._lock:
            events = self._events
            n = len(events)
            taken = events[:n]
            del events[:n]
            rounds = []
            for what, times in self._rounds[:]:
                m = len(times)
                if m:
                    rounds.append((what, times[:m]))
                    del times[:m]
        self._shipped = time.monotonic()
        for (row, phase, args), times in rounds:
            pairs = np.array(times, dtype=np.float64).reshape(-1, 2)
            pairs[:, 1] -= pairs[:, 0]
            pairs[:, 0] += self.offset
            taken += [(row, phase, None, pairs[i:i + _BATCH].tobytes(), args)
                      for i in range(0, len(pairs), _BATCH)]
        return taken


class Writer:
    """Rank 0: writes every rank's events to ``path`` from a thread of its own.

    Args:
        path: the trace file (its directory is created).
        size: ranks in the job (one track each).
        origin: the time (rank 0's monotonic seconds) that is 0 in the trace.
        limit: events waiting to be written beyond which new ones are dropped (counted).
    """

    def __init__(self, path, size, origin, limit=None):
        self.path = path
        self.origin = origin
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        # unbuffered: each batch of events goes out in one write, so that the file always
        # ends at an event's end, whenever this process dies
        self._file = open(path, "wb", buffering=0)
        self._pending = ["["]
        self._first = True
        self._rows = {}             # (rank, row) -> tid
        # (rank, row, phase, id(args)) -> a span's text before and after its times, and its
        # args, kept so that their id names them alone
        self._pieces = {}
        self.dropped = 0
        self._queue = queue.Queue(maxsize=max(1, (limit or config.env_value(
            "TIMELINE_MAX_EVENTS")) // 256))
        for rank in range(size):
            self._emit({"name": "process_name", "ph": "M", "pid": rank,
                        "args": {"name": f"rank {rank}"}})
            self._emit({"name": "process_sort_index", "ph": "M", "pid": rank,
                        "args": {"sort_index": rank}})
        self._flush()
        self._thread = threading.Thread(target=self._run, name="hora-timeline", daemon=True)
        self._thread.start()

    def write(self, rank, events):
        """Queue ``rank``'s ``events`` (from :meth:`Recorder.take`); never blocks."""
        if not events:
            return
        spans = [e for e in events if e[2] is not None]
        chunks = [spans[i:i + _BATCH] for i in range(0, len(spans), _BATCH)]
        chunks += [[e] for e in events if e[2] is None]     # (a batch of rounds)
        for chunk in chunks:
            try:
                self._queue.put_nowait((rank, chunk))
            except queue.Full:
                self.dropped += (len(chunk) if chunk[0][2] is not None
                                 else len(chunk[0][3]) // 16)

    def close(self):
        """Write what is queued, the closing bracket, and close the file."""
        try:        # bounded: a writer thread that stopped (a full disk) drains nothing
            self._queue.put((None, None), timeout=30.0)
        except queue.Full:
            pass
        self._thread.join(30.0)
        if self.dropped:
            log.warning("timeline: %d events were dropped (more than "
                        "HORA_TIMELINE_MAX_EVENTS waited to be written)", self.dropped)
        try:
            self._pending.append("\n]\n")
            self._flush()
            self._file.close()
        except (OSError, ValueError):
            pass

    def _run(self):
        while True:
            rank, events = self._queue.get()
            if events is None:
                return
            try:
                self._put(self._texts(rank, events))
                self._flush()
            except (OSError, ValueError) as e:       # a full disk: stop, say so once
                log.error("timeline: cannot write %s: %s; no more events are written",
                          self.path, e)
                return

    def _texts(self, rank, events):
        """``rank``'s ``events`` as JSON, one string: a span's from cached pieces and its two
        times (json.dumps of each costs five times as much, and the board may record a
        round every few microseconds)."""
        pieces, origin = self._pieces, self.origin
        out = []
        for row, phase, start, dur, args in events:
            got = pieces.get((rank, row, phase, id(args)))
            if start is None:       # a batch of rounds: every span in one formatting
                if got is None:
                    got = self._span_pieces(rank, row, phase, args)
                times = np.frombuffer(dur, dtype=np.float64).reshape(-1, 2).copy()
                times[:, 0] -= origin
                times *= 1e6
                out.append(",\n".join([got[2]] * len(times)) % tuple(times.ravel().tolist()))
                continue
            if dur < 0:             # an instant (CYCLE): on the rank's first row
                out.append(self._instant(rank, phase, start, args))
                continue
            if got is None:
                got = self._span_pieces(rank, row, phase, args)
            # (a time to the nanosecond, as round(t, 3) and json.dumps would write it)
            out.append(f'{got[0]}{(start - origin) * 1e6:.3f},"dur":{dur * 1e6:.3f}{got[1]}')
        return ",\n".join(out)

    def _span_pieces(self, rank, row, phase, args):
        if len(self._pieces) > 4096:    # (an engine's spans bring new args each time)
            self._pieces.clear()
        head = (f'{{"name":{_JSON.encode(phase)},"ph":"X","pid":{rank},'
                f'"tid":{self._tid(rank, row)},"ts":')
        tail = f',"args":{_JSON.encode(args)}}}' if args else "}"
        form = head.replace("%", "%%") + '%.3f,"dur":%.3f' + tail.replace("%", "%%")
        got = self._pieces[(rank, row, phase, id(args))] = (head, tail, form, args)
        return got

    def _instant(self, rank, phase, start, args):
        out = {"name": phase, "ph": "i", "pid": rank,
               "ts": round((start - self.origin) * 1e6, 3), "s": "t", "tid": 0}
        if args:
            out["args"] = args
        return _JSON.encode(out)

    def _tid(self, rank, row):
        tid = self._rows.get((rank, row))
        if tid is None:
            tid = self._rows[(rank, row)] = len(self._rows) + 1
            self._emit({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                        "args": {"name": row}})
        return tid

    def _emit(self, obj):
        self._put(_JSON.encode(obj))

    def _put(self, text):
        self._pending.append(("\n" if self._first else ",\n") + text)
        self._first = False

    def _flush(self):
        data = "".join(self._pending).encode()
        self._pending = []
        view = memoryview(data)
        while view:
            view = view[self._file.write(view):]


# -- turning it on and off ----------------------------------------------------------------------
_writer = None


def start(rank, size, path, mark_cycles=False):
    """Start recording on this rank; rank 0 also writes ``path``.  Any earlier timeline
    of this process stops first."""
    global _recorder, _writer
    stop()
    if rank == 0:
        _writer = Writer(path, size, time.monotonic())
    _recorder = Recorder(rank, clock_offset, mark_cycles)


def writer():
    """Rank 0's :class:`Writer` while a timeline runs, else None."""
    return _writer


def stop():
    """Stop recording; rank 0 writes what it has and closes the file."""
    global _recorder, _writer
    recorder, _recorder = _recorder, None
    w, _writer = _writer, None
    if w is not None:
        if recorder is not None:
            w.write(0, recorder.take())
        w.close()


# -- clock offsets -------------------------------------------------------------------------------
def measure_offsets(rank, topology, ctrl, timeout_s, clock=time.monotonic):
    """Before the engine starts: each rank on another host than rank 0's learns its
    monotonic clock's offset to rank 0's (round trips on the control connection, the one
    with the shortest kept; ranks on one host share its clock, so a host's leader measures
    and tells its host's other ranks; in a tree of leaders, a leader's offset is its
    parent's plus its own to its parent's clock).  Sets :data:`clock_offset`; returns it.

    Args:
        ctrl: this rank's :class:`hora.core.bootstrap.Ctrl` (``up``: the connection to its
            parent, ``down``: ``{rank: socket}`` of the ranks whose connections come here).
        clock: this rank's monotonic clock (a test's skewed one).
    """
    global clock_offset
    hosts = topology.hosts
    offset = clock_offset = 0.0
    if all(h == hosts[0] for h in hosts):
        return 0.0
    if ctrl.up is not None and hosts[rank] != hosts[0]:
        up = _raw(ctrl.up)
        was = up.gettimeout()
        up.settimeout(timeout_s)
        if hosts[ctrl.parent] != hosts[rank]:   # this host's leader: its parent measures
            for _ in range(_PINGS):
                recv_exact(up, _F64.size, f"rank {ctrl.parent}")
                up.sendall(_F64.pack(clock()))
        (offset,) = _F64.unpack(recv_exact(up, _F64.size, f"rank {ctrl.parent}"))
        up.settimeout(was)
    for r, sock in ctrl.down.items():
        sock = _raw(sock)
        if hosts[r] == hosts[rank]:
            if hosts[rank] != hosts[0]:     # the leader's host: its offset (rank 0's: none)
                sock.sendall(_F64.pack(offset))
        else:           # a leader below: its offset to this clock, plus this one's to rank 0
            sock.sendall(_F64.pack(offset + _ping(sock, timeout_s, clock)))
    clock_offset = offset
    return offset


def _raw(sock):
    """The socket itself under a control connection that carries its pair's data too
    (:mod:`hora.backends.mux`): these round trips come before any frame on it, both ways,
    and read exactly what they expect."""
    shared = getattr(sock, "shared", None)
    return sock if shared is None else shared.sock


def _ping(sock, timeout_s, clock):
    """Rank 0's side of a leader's measure: its clock's offset to the leader's."""
    was = sock.gettimeout()
    sock.settimeout(timeout_s)
    best = (math.inf, 0.0)
    for _ in range(_PINGS):
        t0 = clock()
        sock.sendall(_F64.pack(t0))
        (theirs,) = _F64.unpack(recv_exact(sock, _F64.size, "rank 0's peer"))
        t1 = clock()
        best = min(best, (t1 - t0, (t0 + t1) / 2 - theirs))
    sock.settimeout(was)
    return best[1]


# -- reading a trace back ------------------------------------------------------------------------
def load(path):
    """The events of a trace file, complete or cut short by a crash (no closing bracket)."""
    with open(path) as f:
        text = f.read().strip()
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    data = json.loads(text)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize(events):
    """Per tensor and phase: count, mean and p99 in ms, bytes; per rank: how often it was the
    last to arrive at rank 0 (from ``NEGOTIATION`` spans).  Returns ``(rows, last)``:
    ``rows``: ``[(tensor, phase, count, mean_ms, p99_ms, bytes)]``; ``last``: ``{rank:
    count}``; and the total ms per (rank, phase) as a third item."""
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e["pid"], e["tid"])] = e["args"]["name"]
    spans = collections.defaultdict(list)
    nbytes = collections.defaultdict(int)
    per_rank = collections.defaultdict(float)
    last = collections.Counter()
    for e in events:
        if e.get("ph") != "X":
            continue
        tensor = names.get((e["pid"], e.get("tid")), "?")
        phase = e["name"]
        if phase == "NEGOTIATION":
            last[e["args"]["last"]] += 1
            continue
        kind = phase.split()[0] if phase not in PHASES else phase
        spans[(tensor, phase)].append(e["dur"] / 1000.0)
        per_rank[(e["pid"], "COLLECTIVE" if kind not in PHASES else kind)] += e["dur"] / 1000.0
        if "bytes" in e.get("args", {}) and phase not in ("QUEUE", "NEGOTIATE"):
            nbytes[(tensor, phase)] += e["args"]["bytes"]
    rows = []
    for (tensor, phase), durs in sorted(spans.items()):
        durs.sort()
        p99 = durs[min(len(durs) - 1, int(math.ceil(0.99 * len(durs))) - 1)]
        rows.append((tensor, phase, len(durs), sum(durs) / len(durs), p99,
                     nbytes.get((tensor, phase), 0)))
    return rows, dict(last), dict(per_rank)



# -- hora timeline FILE ----------------------------------------------------------------------
def add_command(subparsers):
    """Register ``hora timeline FILE [--plot PNG]``."""
    cmd = subparsers.add_parser(
        "timeline", help="summarize a timeline file (HORA_TIMELINE)",
        description="Print, per tensor and phase, the count, mean and p99 time and the bytes, "
                    "and per rank how often it was the last to reach rank 0; with --plot, "
                    "draw where each rank's time goes.")
    cmd.add_argument("file", help="the trace rank 0 wrote (HORA_TIMELINE)")
    cmd.add_argument("--plot", metavar="PNG", help="also write a bar chart of each rank's "
                                                   "time per phase")
    cmd.add_argument("--top", type=int, default=40, metavar="N",
                     help="rows of the table, by total time (default 40)")
    cmd.set_defaults(handler=_command)


def _command(args):
    try:
        events = load(args.file)
    except (OSError, ValueError) as e:
        print(f"hora timeline: cannot read {args.file}: {e}")
        return 2
    rows, last, per_rank = summarize(events)
    ranks = sorted({e["pid"] for e in events if "pid" in e})
    print(f"{args.file}: {len(events)} events, {len(ranks)} rank(s)\n")
    print(f"{'tensor':<32} {'phase':<22} {'count':>7} {'mean ms':>9} {'p99 ms':>9} "
          f"{'MB':>9}")
    rows.sort(key=lambda r: -r[2] * r[3])
    for tensor, phase, count, mean, p99, nbytes in rows[:args.top]:
        print(f"{tensor[:32]:<32} {phase[:22]:<22} {count:>7} {mean:>9.3f} {p99:>9.3f} "
              f"{nbytes / 1e6:>9.2f}")
    if len(rows) > args.top:
        print(f"... {len(rows) - args.top} more rows (--top)")
    total = sum(last.values())
    if total:
        print(f"\nlast to reach rank 0, of {total} negotiations:")
        for rank in sorted(last, key=lambda r: -last[r]):
            print(f"  rank {rank}: {last[rank]} ({100.0 * last[rank] / total:.0f}%)")
    if args.plot:
        _plot(args.plot, per_rank, ranks)
    return 0


def _plot(path, per_rank, ranks):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot)")
        return
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.45 * len(ranks)))
    left = [0.0] * len(ranks)
    for phase in PHASES:
        widths = [per_rank.get((r, phase), 0.0) for r in ranks]
        ax.barh([f"rank {r}" for r in ranks], widths, left=left, label=phase.lower())
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("ms spent in each phase, summed over the trace's collectives")
    ax.set_title("Where each rank's collective time goes")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")
