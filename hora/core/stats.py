"""The engine's counters since ``init()``: ``hora.metrics()``, and rank 0's TensorBoard files.

Every rank counts, as its engine runs: the collectives and their bytes by kind, the data
plane each allreduce took, the time from sending a request to rank 0 until its answer
(negotiation), the fusion (buffers, tensors in them, bytes against the threshold), the
response cache's hits, and the training steps the framework bindings report
(:func:`step`).  Rank 0 also counts how long each collective waited for its slowest rank
and which rank that was, and the stall warnings.  Counting is a few additions per
collective; the counters are plain attributes, read without a lock (a snapshot may be a
collective behind).

``HORA_METRICS_DIR=DIR`` (or :func:`write_metrics`) makes rank 0 write them every
``HORA_METRICS_PERIOD`` seconds as TensorBoard scalars (``hora/<name>`` averaged over the
ranks, ``hora/rank<r>/<name>`` each rank's), with TensorBoard's own event writer; the other
ranks send rank 0 their numbers on the control connection (:class:`~hora.core.wire.Stats`).

Layer: core.
"""
import collections
import logging
import os
import socket
import threading
import time

from .. import config
from . import state

__all__ = ["Counters", "counters", "metrics", "step", "write_metrics", "scalars", "MetricsWriter"]

log = logging.getLogger(__name__)


class Counters:
    """One process's counters (see the module docstring)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.started = time.monotonic()
        # (defaultdicts: a Counter's item update costs twice a dict's, on every collective)
        self.collectives = collections.defaultdict(int)     # kind -> count
        self.bytes = collections.defaultdict(int)           # kind -> bytes
        self.planes = collections.defaultdict(int)          # data plane -> allreduces
        self.fallbacks = collections.defaultdict(int)       # why the board passed -> count
        self.negotiations = 0
        self.negotiation_s = 0.0
        self.waits = 0                               # rank 0: completed negotiations
        self.wait_s = 0.0                            # ... time from first to last arrival
        self.last = collections.defaultdict(int)     # ... rank -> times it came last
        self.fused_buffers = 0
        self.fused_tensors = 0
        self.fused_bytes = 0
        self.cache_hits = 0
        self.cache_misses = 0
        self.stall_warnings = 0
        self.steps = 0
        self.sent = {}                               # (set, name) -> time sent to rank 0
        self.last_op = None                          # (kind, name) of the last one run
        self.plane = None                            # the data plane of the last allreduce
        # the blocking allreduces the board settled through a lane (Engine.lane_now), apart
        # from the dicts above: three additions a call instead of a call of several lookups,
        # which a loop of small allreduces pays in every round (metrics() adds them in:
        # allreduces on the "board" plane)
        self.lane_calls = 0
        self.lane_bytes = 0
        self.lane_unwaited = 0                       # rank 0: of them, those nobody waited for
        # control messages (hora.core.engine.conn): [received, their bytes, sent, their bytes]
        self.ctrl = [0, 0, 0, 0]


counters = Counters()
_threshold = [128 << 20]        # the fusion threshold of the job (for the fill)
_job = [0, 1]                   # rank, size


def started(rank, size, fusion_threshold):
    """``init()``: count from zero for this job."""
    counters.reset()
    _threshold[0] = max(1, fusion_threshold)
    _job[:] = [rank, size]


def step(n=1):
    """A framework binding's optimizer took ``n`` training steps (for steps per second)."""
    counters.steps += n


def metrics():
    """This rank's counters since ``init()``, as a dict of plain values.

    Keys: ``rank``, ``size``, ``uptime_s``, ``collectives`` and ``bytes`` (by kind),
    ``data_plane`` (allreduces by plane: ``shm``, ``tcp``, ``hierarchical``, ...; ``rank 0``
    for the small ones rank 0 reduces, ``board`` for the blocking small ones of a one-host
    job, :mod:`hora.core.engine.board`), ``board_fallbacks`` (blocking small calls this rank
    sent from the board to the engine, by the reason it saw: ``told`` (a worker, by its
    host's rank 0), ``busy`` (the engine had work under way), ``patience`` (a rank did not
    post within PATIENCE_S), ``differ`` (the posts differ), ``vetoed``, ``urged`` and
    ``retreat`` (across hosts: another leader vetoed the round, asked for its veto, or
    went to the engine with it meanwhile), ``drive`` (the engine's thread kept it a
    second), ``stopped``; a leader's vetoes of rounds it was not playing count as
    ``idle <reason>``), ``negotiation_ms`` (mean time from request to
    answer), ``fusion`` (``buffers``, ``tensors_per_buffer``, ``fill``: mean bytes per buffer
    over the fusion threshold), ``cache_hit_rate`` (None before any request), ``steps``,
    ``control`` (control messages and their bytes, framed: ``received``, ``received_bytes``,
    ``sent``, ``sent_bytes``);
    on rank 0 also ``wait_for_slowest_ms`` (mean time from the first rank's request to the
    last's), ``last_to_arrive`` (rank -> count) and ``stall_warnings``.
    """
    c = counters
    requests = c.cache_hits + c.cache_misses
    kinds, nbytes, planes = dict(c.collectives), dict(c.bytes), dict(c.planes)
    lanes, unwaited = c.lane_calls, c.lane_unwaited
    if lanes:
        kinds["allreduce"] = kinds.get("allreduce", 0) + lanes
        nbytes["allreduce"] = nbytes.get("allreduce", 0) + c.lane_bytes
        planes["board"] = planes.get("board", 0) + lanes
    out = {
        "rank": _job[0], "size": _job[1], "uptime_s": time.monotonic() - c.started,
        "collectives": kinds, "bytes": nbytes,
        "data_plane": planes, "board_fallbacks": dict(c.fallbacks),
        "negotiation_ms": 1e3 * c.negotiation_s / c.negotiations if c.negotiations else None,
        "fusion": {"buffers": c.fused_buffers,
                   "tensors_per_buffer": (c.fused_tensors / c.fused_buffers
                                          if c.fused_buffers else None),
                   "fill": (c.fused_bytes / c.fused_buffers / _threshold[0]
                            if c.fused_buffers else None)},
        "cache_hit_rate": c.cache_hits / requests if requests else None,
        "steps": c.steps,
        "control": dict(zip(("received", "received_bytes", "sent", "sent_bytes"), c.ctrl)),
    }
    if _job[0] == 0:
        waits, last = c.waits + unwaited, {int(r): n for r, n in c.last.items()}
        if unwaited:
            last[0] = last.get(0, 0) + unwaited
        out.update(wait_for_slowest_ms=1e3 * c.wait_s / waits if waits else None,
                   last_to_arrive=last, stall_warnings=c.stall_warnings)
    return out


def scalars(m, previous=None):
    """The numbers of ``metrics()`` that TensorBoard plots, flat: rates over the time since
    ``previous`` (an earlier ``(metrics, scalars)`` pair) where given."""
    out = {"collectives": float(sum(m["collectives"].values())),
           "megabytes": sum(m["bytes"].values()) / 1e6, "steps": float(m["steps"])}
    for name in ("negotiation_ms", "cache_hit_rate", "wait_for_slowest_ms"):
        if m.get(name) is not None:
            out[name] = float(m[name])
    if m["fusion"]["fill"] is not None:
        out["fusion_fill"] = float(m["fusion"]["fill"])
    if "stall_warnings" in m:
        out["stall_warnings"] = float(m["stall_warnings"])
    if previous is not None:
        dt = m["uptime_s"] - previous["uptime_s"]
        if dt > 0:
            prev = scalars(previous)
            for name, per_s in (("collectives", "collectives_per_s"),
                                ("megabytes", "megabytes_per_s"), ("steps", "steps_per_s")):
                out[per_s] = (out[name] - prev[name]) / dt
    return out


# -- TensorBoard ---------------------------------------------------------------------------------
class MetricsWriter:
    """Rank 0: every ``period_s``, every rank's latest metrics as TensorBoard scalars in
    ``logdir`` (a thread of its own).

    Raises:
        ImportError: TensorBoard is not installed (``pip install tensorboard``).
    """

    def __init__(self, logdir, size, period_s):
        # TensorBoard's record writer and protocol buffers, not its EventFileWriter, which
        # imports TensorFlow when it is installed (seconds, and its log lines)
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.summary.writer.record_writer import RecordWriter
        self.logdir = logdir
        self.period_s = period_s
        self._size = size
        os.makedirs(logdir, exist_ok=True)
        # TensorBoard reads every events.out.tfevents.* of the directory, in name order
        name = (f"events.out.tfevents.{time.time():.3f}.{socket.gethostname()}."
                f"{os.getpid()}.hora")
        self._file = open(os.path.join(logdir, name), "wb")
        self._writer = RecordWriter(self._file)
        self._writer.write(Event(wall_time=time.time(), step=0,
                                 file_version="brain.Event:2").SerializeToString())
        self._writer.flush()
        self._latest = {}           # rank -> its metrics()
        self._previous = {}         # rank -> the metrics written last time
        self._step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hora-metrics", daemon=True)
        self._thread.start()

    def take(self, rank, values):
        """``rank``'s latest ``metrics()``."""
        self._latest[rank] = values

    def close(self):
        self._stop.set()
        self._thread.join(10.0)
        self._write()
        self._writer.close()

    def _run(self):
        while not self._stop.wait(self.period_s):
            try:
                self._write()
            except Exception as e:          # a full disk: say so, keep training
                log.error("metrics: cannot write TensorBoard files to %s: %s", self.logdir, e)
                return

    def _write(self):
        self._latest[0] = metrics()
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        per_rank = {}
        for rank, m in sorted(self._latest.items()):
            per_rank[rank] = scalars(m, self._previous.get(rank))
            self._previous[rank] = m
        values = []
        for name in sorted({n for s in per_rank.values() for n in s}):
            got = [s[name] for s in per_rank.values() if name in s]
            values.append(Summary.Value(tag=f"hora/{name}", simple_value=sum(got) / len(got)))
            for rank, s in per_rank.items():
                if name in s:
                    values.append(Summary.Value(tag=f"hora/rank{rank}/{name}",
                                                simple_value=s[name]))
        self._step += 1
        self._writer.write(Event(wall_time=time.time(), step=self._step,
                                 summary=Summary(value=values)).SerializeToString())
        self._writer.flush()


_writer = None


def write_metrics(logdir, period_s=None):
    """Rank 0 writes every rank's metrics to ``logdir`` as TensorBoard scalars every
    ``period_s`` seconds (default HORA_METRICS_PERIOD) until ``shutdown()``; call it on
    every rank (the others send theirs).  ``HORA_METRICS_DIR`` does this at ``init()``."""
    global _writer
    stop_writing()
    ctx = state._require()
    period = float(period_s if period_s is not None else config.env_value("METRICS_PERIOD"))
    _shipping[:] = [period, time.monotonic()]
    if ctx.placement.rank == 0:
        try:
            _writer = MetricsWriter(os.fspath(logdir), ctx.placement.size, period)
        except ImportError:
            log.warning("HORA_METRICS_DIR=%s: TensorBoard's writer is not installed (pip "
                        "install tensorboard); no metrics are written", logdir)


_shipping = [0.0, 0.0]          # a worker sends rank 0 its metrics this often (0: never), last


def writer():
    return _writer


def due(leaving=False):
    """A worker: time to send rank 0 its metrics (always the last time, ``leaving``)."""
    period, last = _shipping
    if period <= 0 or (not leaving and time.monotonic() - last < period):
        return False
    _shipping[1] = time.monotonic()
    return True


def stop_writing():
    global _writer
    w, _writer = _writer, None
    _shipping[:] = [0.0, 0.0]
    if w is not None:
        w.close()


# -- hora run --monitor: every rank's status in the launcher's store -----------------------------
MONITOR_PREFIX = "monitor/"
_MONITOR_S = 0.5
_STALLED_S = 5.0                # a request unanswered this long: the status says "waiting"
_reporter = None


def status():
    """This rank's one-line status for ``hora run --monitor`` (plain data)."""
    c = counters
    now = time.monotonic()
    oldest = min(c.sent.values(), default=None)
    waiting = None
    if oldest is not None and now - oldest >= _STALLED_S:
        name = min(c.sent, key=c.sent.get)[1]
        waiting = (name, now - oldest)
    return {"rank": _job[0], "size": _job[1], "time": time.time(),
            "collectives": int(sum(c.collectives.values())) + c.lane_calls, "steps": c.steps,
            "last": c.last_op, "plane": c.plane,
            "negotiation_ms": 1e3 * c.negotiation_s / c.negotiations if c.negotiations else None,
            "waiting": waiting, "host": socket.gethostname()}


class _Reporter:
    """A worker thread that puts :func:`status` into the launcher's store twice a second."""

    def __init__(self, client_factory, host):
        self._factory = client_factory
        self._host = host
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hora-monitor", daemon=True)
        self._thread.start()

    def _run(self):
        try:
            client = self._factory()
        except Exception as e:          # the launcher is gone: nothing to report to
            log.debug("monitor: cannot reach the launcher's store: %s", e)
            return
        try:
            while not self._stop.wait(_MONITOR_S):
                values = status()
                values["host"] = self._host
                client.put(f"{MONITOR_PREFIX}{values['rank']}", values)
        except Exception as e:
            log.debug("monitor: stopped reporting: %s", e)
        finally:
            client.close()

    def stop(self):
        self._stop.set()
        self._thread.join(2.0)


def report_to_launcher(client_factory, host):
    """Start putting this rank's status into the launcher's store (``hora run
    --monitor``)."""
    global _reporter
    stop_reporting()
    _reporter = _Reporter(client_factory, host)


def stop_reporting():
    global _reporter
    r, _reporter = _reporter, None
    if r is not None:
        r.stop()
