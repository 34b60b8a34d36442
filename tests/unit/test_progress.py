"""Progress of long work: ``hora bench``'s "job k of N" with the time left (plain lines, the
plain bar, rich's bar) and the synthetic benchmarks' warm-up lines, on a fake clock."""
import io
import pathlib
import sys

import pytest

from hora.bench import progress
from hora.bench.progress import Progress, estimate_left, format_left

ROOT = pathlib.Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_estimate_uses_each_jobs_own_past_else_the_mean_of_all():
    assert estimate_left({}, ["a", "b"]) is None
    past = {"a": [2.0, 4.0], "b": [9.0]}
    assert estimate_left(past, []) == 0
    assert estimate_left(past, ["a", "b"]) == pytest.approx(3.0 + 9.0)
    assert estimate_left(past, ["c"]) == pytest.approx(5.0)        # (2 + 4 + 9) / 3


@pytest.mark.parametrize("seconds, text", [
    (None, ""), (0, "done"), (0.2, "about 1 s left"), (40.4, "about 40 s left"),
    (89, "about 89 s left"), (150, "about 2 min left"), (3 * 3600 + 5 * 60, "about 3 h 5 min left"),
])
def test_time_left_reads_as_a_person_says_it(seconds, text):
    assert format_left(seconds) == text


def _run(progress, clock, jobs):
    """Run ``jobs`` ((label, key, seconds, status or None to skip)) through ``progress``."""
    progress.plan(key for _, key, _, _ in jobs)
    for label, key, seconds, status in jobs:
        if status is None:
            progress.skip(key)
            continue
        progress.start(label, key)
        clock.now += seconds
        progress.done(label, status, key)
    progress.close()


_JOBS = [("hora N=2 (1/2)", "h", 2.0, "ok"), ("gloo N=2 (1/2)", "g", 6.0, "FAILED: boom"),
         ("gloo N=2 (2/2)", "g", 0.0, None), ("hora N=2 (2/2)", "h", 3.0, "ok")]


def test_plain_lines_count_the_jobs_and_say_the_time_left():
    out, clock = io.StringIO(), Clock()
    _run(Progress(len(_JOBS), stream=out, clock=clock), clock, _JOBS)
    assert out.getvalue().splitlines() == [
        "[bench] hora N=2 (1/2): 2.0 s, ok; job 1 of 4, about 6 s left",   # 3 jobs at 2 s
        # the next gloo job is still planned here: skipped only as its turn comes
        "[bench] gloo N=2 (1/2): 6.0 s, FAILED: boom; job 2 of 4, about 8 s left",
        "[bench] hora N=2 (2/2): 3.0 s, ok; job 3 of 3, done",     # the skipped job is gone
    ]


def test_on_a_terminal_without_rich_a_plain_bar_sits_below_the_lines(monkeypatch):
    monkeypatch.setitem(sys.modules, "rich.progress", None)      # import fails: no rich
    out, clock = io.StringIO(), Clock()
    _run(Progress(len(_JOBS), stream=out, bar=True, clock=clock), clock, _JOBS)
    text = out.getvalue()
    assert "\r\x1b[K[bench] [" + "." * 24 + "] job 1 of 4: hora N=2 (1/2)" in text
    assert "[" + "#" * 6 + "." * 18 + "] job 2 of 4, about 6 s left" in text     # between jobs
    assert "[" + "#" * 16 + "." * 8 + "] job 3 of 3, about 2 s left" in text     # one skipped
    # every finished job's line replaces the bar, whole; the run ends with the bar cleared
    lines = [part.rsplit("\x1b[K", 1)[-1] for part in text.split("\n")]
    assert lines[:3] == ["[bench] hora N=2 (1/2): 2.0 s, ok; job 1 of 4, about 6 s left",
                         "[bench] gloo N=2 (1/2): 6.0 s, FAILED: boom; job 2 of 4, about 8 s "
                         "left",
                         "[bench] hora N=2 (2/2): 3.0 s, ok; job 3 of 3, done"]
    assert text.endswith("\r\x1b[K")


def test_rich_prints_the_same_lines_above_its_bar():
    pytest.importorskip("rich")
    out, clock = io.StringIO(), Clock()
    _run(Progress(len(_JOBS), stream=out, bar=True, clock=clock), clock, _JOBS)
    assert "[bench] gloo N=2 (1/2): 6.0 s, FAILED: boom; job 2 of 4, about 8 s left" in \
        out.getvalue()


def test_not_a_terminal_means_no_bar():
    out = io.StringIO()
    progress = Progress(3, stream=out)
    assert progress._rich is None and not progress._plain
    progress.close()


# -- the synthetic benchmarks' warm-up ----------------------------------------------------------
@pytest.mark.parametrize("example", ["tensorflow2_synthetic_benchmark.py",
                                     "pytorch_synthetic_benchmark.py"])
def test_warm_up_says_how_far_it_is(example, monkeypatch):
    assert "from hora.bench.progress import warm_up" in (ROOT / "examples" / example).read_text()
    clock = Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    warm_up = progress.warm_up
    lines = []

    def step(seconds):
        def run():
            clock.now += seconds
        return run
    warm_up([step(30.0)] + [step(2.0)] * 10, lines.append)      # a slow first step
    assert lines[0] == "Running warmup (11 steps)..."
    assert lines[1].startswith("Warmup step 1 of 11: 30.0 s (")
    # then at most one line every 5 s: after steps 4, 7 and 10 (2 s each), with the time left
    assert lines[2:5] == ["Warmup step 4 of 11: 2.00 s a step, about 14 s left",
                          "Warmup step 7 of 11: 2.00 s a step, about 8 s left",
                          "Warmup step 10 of 11: 2.00 s a step, about 2 s left"]
    assert lines[5:] == ["Warmup done: 11 steps in 50.0 s"]
    lines.clear()
    warm_up([step(0.01)] * 10, lines.append)                    # short steps: three lines
    assert len(lines) == 3 and lines[-1] == "Warmup done: 10 steps in 0.1 s"
