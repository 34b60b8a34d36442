"""``hora run --monitor``: one status line per rank (per host when there are many) below the
workers' scrolling output, on a terminal.

Each worker (``HORA_MONITOR=1``) puts its status into the launcher's rendezvous store twice
a second (:func:`hora.core.stats.status`): collectives and training steps so far, the last
collective, the data plane of the last allreduce, the mean negotiation time, and the
request it has been waiting on for 5 s or more.  The launcher redraws the table twice a
second with rich's ``Live``, which prints the workers' lines above it.  When stdout is not
a terminal, or rich is not installed, nothing changes (one log line says why).

Layer: runner.  Imports rich (when asked for); reads the store only.
"""
import logging
import sys
import time

__all__ = ["Monitor", "render_rows", "MONITOR_PREFIX"]

log = logging.getLogger(__name__)

MONITOR_PREFIX = "monitor/"     # as hora.core.stats.MONITOR_PREFIX (the runner imports no core)
_FRESH_S = 3.0                  # a status older than this is a rank that stopped reporting
_PER_HOST_ABOVE = 16            # more ranks than this: a line per host


def render_rows(statuses, previous, now):
    """The table's rows from the workers' latest ``statuses`` (``{rank: status}``) and the
    ones before (``previous``, for the rates): ``[(who, steps/s, coll/s, last, plane,
    negotiation, state)]``, a rank a row, or a host a row above ``_PER_HOST_ABOVE`` ranks."""
    rows = []
    for rank in sorted(statuses):
        s = statuses[rank]
        p = previous.get(rank)
        steps_s = coll_s = None
        if p is not None and s["time"] > p["time"]:
            dt = s["time"] - p["time"]
            steps_s = (s["steps"] - p["steps"]) / dt
            coll_s = (s["collectives"] - p["collectives"]) / dt
        last = f"{s['last'][0]} {s['last'][1]}" if s.get("last") else "-"
        if now - s["time"] > _FRESH_S:
            state = f"silent {now - s['time']:.0f} s"
        elif s.get("waiting"):
            name, waited = s["waiting"]
            state = f"waiting {waited:.0f} s for {name}"
        else:
            state = "running"
        neg = s.get("negotiation_ms")
        rows.append((f"rank {rank} ({s.get('host', '?')})", steps_s, coll_s, last,
                     s.get("plane") or "-", None if neg is None else neg, state, s.get("host")))
    if len(rows) <= _PER_HOST_ABOVE:
        return [r[:7] for r in rows]
    hosts = {}
    for r in rows:
        hosts.setdefault(r[7], []).append(r)
    out = []
    for host, members in hosts.items():
        def total(i):
            values = [m[i] for m in members if m[i] is not None]
            return sum(values) if values else None
        neg = [m[5] for m in members if m[5] is not None]
        states = sorted({m[6] for m in members if m[6] != "running"})
        out.append((f"{host} ({len(members)} ranks)", total(1), total(2), members[-1][3],
                    members[-1][4], sum(neg) / len(neg) if neg else None,
                    "; ".join(states) if states else "running"))
    return out


class Monitor:
    """The live status table of a running job, fed by the launcher's store.

    Args:
        server: the job's :class:`~hora.rendezvous.RendezvousServer`.
    """

    def __init__(self, server, stream=None):
        self._server = server
        self._stream = stream or sys.stdout
        self._live = None
        self._previous = {}
        self._shown = {}

    def start(self):
        """Start drawing; False (and a log line) when it cannot: not a terminal, no rich."""
        if not self._stream.isatty():
            log.info("--monitor: stdout is not a terminal; no status lines")
            return False
        try:
            from rich.console import Console
            from rich.live import Live
        except ImportError:
            log.warning("--monitor needs rich: pip install rich (or 'hora[monitor]')")
            return False
        self._live = Live(get_renderable=self._table, console=Console(file=self._stream),
                          refresh_per_second=2, redirect_stdout=True, redirect_stderr=True)
        self._live.start()
        return True

    def stop(self):
        if self._live is not None:
            self._live.stop()
            self._live = None

    def _statuses(self):
        out = {}
        for key, value in self._server.items(MONITOR_PREFIX).items():
            if type(value) is dict and "rank" in value:
                out[value["rank"]] = value
        return out

    def _table(self):
        from rich.table import Table
        statuses = self._statuses()
        now = time.time()
        # rates over at least a second: the statuses come twice a second
        for rank, s in statuses.items():
            shown = self._shown.get(rank)
            if shown is None or s["time"] - shown["time"] >= 1.0:
                self._previous[rank], self._shown[rank] = shown or s, s
        table = Table(title="hora: job status", title_justify="left", expand=False)
        for column in ("rank", "steps/s", "coll/s", "last collective", "plane",
                       "negotiation ms", "state"):
            table.add_column(column, no_wrap=True)
        if not statuses:
            table.add_row("(waiting for the ranks' first report)", "", "", "", "", "", "")
            return table
        for who, steps_s, coll_s, last, plane, neg, state in render_rows(
                self._shown, self._previous, now):
            table.add_row(who, _num(steps_s), _num(coll_s), last[:40], plane, _num(neg),
                          state)
        return table


def _num(value):
    return "-" if value is None else f"{value:.1f}"
