"""Progress of a long benchmark run: "job k of N" and the time left.

One line per finished job (``[bench] hora N=2 (1/3): 0.8 s, ok; job 1 of 12, about 2 min
left``) always; where the stream is a terminal, a bar below those lines as well: rich's when
``rich`` is installed (the ``monitor`` extra), else a plain one drawn with ``\\r``.

The time left is pure arithmetic (:func:`estimate_left`): each job still to run is expected
to take what the same job took on its earlier launches, or, if it has not run yet, the mean
of every job so far.  A run launches every (system, N) job a few times in turn, so from the
second launch on the estimate rests on the jobs' own times.

Layer: bench.  Imports nothing from hora.
"""
import statistics
import sys
import time
from collections.abc import Hashable, Mapping, Sequence

__all__ = ["Progress", "estimate_left", "format_left", "warm_up", "WARMUP_REPORT_S"]

_BAR_WIDTH = 24         # characters of the plain bar: fits an 80-column line with its text
WARMUP_REPORT_S = 5.0   # a warm-up says how far it is this often at most


def estimate_left(past: Mapping[Hashable, Sequence[float]],
                  remaining: Sequence[Hashable]) -> "float | None":
    """Seconds the ``remaining`` jobs should take, from the ``past`` durations (seconds) of
    the jobs that ran, by key; None while no job has run.

    A job whose key ran before is expected to take the mean of its own runs; any other, the
    mean of every run so far.
    """
    runs = [t for times in past.values() for t in times]
    if not runs:
        return None
    overall = statistics.fmean(runs)
    return sum(statistics.fmean(past[key]) if past.get(key) else overall for key in remaining)


def format_left(seconds: "float | None") -> str:
    """``"about 40 s left"``, ``"about 3 min left"``, ``"about 1 h 5 min left"``; ``""`` for
    None (nothing to go on yet) and ``"done"`` for 0."""
    if seconds is None:
        return ""
    if seconds <= 0:
        return "done"
    if seconds < 90:
        return f"about {max(1, round(seconds))} s left"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"about {minutes} min left"
    return f"about {minutes // 60} h {minutes % 60} min left"


class Progress:
    """The progress of ``total`` jobs, written to ``stream``.

    Call :meth:`start` as a job begins, :meth:`done` as it ends, :meth:`skip` for a job that
    will not run, and :meth:`close` at the end (or use it as a context manager).

    Args:
        total: the number of jobs the run plans.
        stream: where the lines (and the bar) go (default ``sys.stderr``).
        bar: draw a bar: True, False, or None for "where ``stream`` is a terminal".
        prefix: the start of every line.
        clock: seconds, monotonic (a test passes its own).
    """

    def __init__(self, total, stream=None, bar=None, prefix="[bench] ", clock=time.monotonic):
        self.total = total
        self.finished = 0
        self._stream = stream if stream is not None else sys.stderr
        self._prefix = prefix
        self._clock = clock
        self._past = {}
        self._remaining = []
        self._label = ""
        if bar is None:
            bar = bool(getattr(self._stream, "isatty", lambda: False)())
        self._rich = _rich_bar(self._stream, total) if bar else None
        self._plain = bar and self._rich is None
        self._drawn = False

    def plan(self, keys):
        """The keys of the jobs still to run, the running one included (what
        :func:`estimate_left` sums); :meth:`done` and :meth:`skip` take them off."""
        self._remaining = list(keys)

    def start(self, label, key=None):
        """Job ``label`` (whose past runs are filed under ``key``) begins."""
        self._label = label
        self._started = self._clock()
        self._draw()

    def done(self, label, status, key=None):
        """Job ``label`` ended with ``status`` (``"ok"``, ``"FAILED: ..."``): one line."""
        took = self._clock() - self._started
        self._past.setdefault(key, []).append(took)
        self._forget(key)
        self.finished += 1
        left = format_left(self.left())
        self._line(f"{self._prefix}{label}: {took:.1f} s, {status}; job {self.finished} of "
                   f"{self.total}{', ' + left if left else ''}")
        self._label = ""                    # until the next job starts
        self._draw()

    def skip(self, key=None):
        """A planned job will not run (its system failed earlier)."""
        self.total -= 1
        self._forget(key)
        self._draw()

    def _forget(self, key):
        if key in self._remaining:
            self._remaining.remove(key)     # the first of equal keys: any one will do

    def left(self):
        """Seconds the jobs not yet finished should take (None: nothing to go on yet)."""
        return estimate_left(self._past, self._remaining)

    def close(self):
        if self._rich is not None:
            self._rich[0].stop()
        elif self._drawn:
            self._stream.write("\r\033[K")
            self._stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _line(self, text):
        if self._rich is not None:
            self._rich[0].console.print(text, highlight=False, markup=False)
            return
        if self._drawn:
            self._stream.write("\r\033[K")      # the bar's line becomes this line
            self._drawn = False
        print(text, file=self._stream, flush=True)

    def _draw(self):
        left = format_left(self.left())
        now = min(self.finished + 1, self.total)
        text = (f"job {now} of {self.total}" + (f": {self._label}" if self._label else "")
                + (f", {left}" if left else ""))
        if self._rich is not None:
            progress, task = self._rich
            progress.update(task, total=self.total, completed=self.finished, description=text)
        elif self._plain:
            filled = _BAR_WIDTH * self.finished // max(self.total, 1)
            bar = "#" * filled + "." * (_BAR_WIDTH - filled)
            self._stream.write(f"\r\033[K{self._prefix}[{bar}] {text}")
            self._stream.flush()
            self._drawn = True


def _rich_bar(stream, total):
    """rich's live bar on ``stream``, started, as (progress, task); None without rich."""
    try:
        from rich.console import Console
        from rich.progress import BarColumn, Progress as RichProgress, TextColumn
    except ImportError:
        return None
    progress = RichProgress(BarColumn(), TextColumn("{task.description}"),
                            console=Console(file=stream), transient=True)
    task = progress.add_task("", total=total)
    progress.start()
    return progress, task


def warm_up(steps, log, first="it sets everything up", report_s=WARMUP_REPORT_S):
    """Run ``steps`` (callables) untimed, saying through ``log`` how far the warm-up is: a
    line after the first step (the slowest; ``first`` says why), then at most one every
    ``report_s`` seconds with the time left (the later steps' mean times the steps to go),
    and one at the end.  A large model on a CPU takes seconds a step (the synthetic
    benchmarks in ``examples/``): without these lines the job looks stuck."""
    total, begun = len(steps), time.monotonic()
    log(f"Running warmup ({total} steps)...")
    last = after_first = begun
    for k, run in enumerate(steps, 1):
        run()
        now = time.monotonic()
        if k == 1 and total > 1:
            log(f"Warmup step 1 of {total}: {now - begun:.1f} s ({first})")
            last = after_first = now
        elif k < total and now - last >= report_s:
            per_step = (now - after_first) / (k - 1)
            log(f"Warmup step {k} of {total}: {per_step:.2f} s a step, about "
                f"{per_step * (total - k):.0f} s left")
            last = now
    log(f"Warmup done: {total} steps in {time.monotonic() - begun:.1f} s")
