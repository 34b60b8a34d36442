"""``hora bench``'s line probe between two real processes: ranks 0 and 1 bounce a word through
a shared file, each pinned to a CPU of its own for the probe, and a missing partner costs one
bounded wait, then nothing."""
import multiprocessing as mp
import os
import statistics
import time

import pytest

from hora.bench import ranks
from hora.bench.ranks import LINE_FILE_BYTES, LineProbe

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                reason="the line probe pins its two ranks to two CPUs")


@pytest.fixture
def line_file(tmp_path):
    path = tmp_path / "line"
    path.write_bytes(bytes(LINE_FILE_BYTES))
    return str(path)


def _rank(rank, path, rounds, out):
    before = os.sched_getaffinity(0)
    probe = LineProbe(rank, 2, path)
    got = [probe.probe() for _ in range(rounds)]
    out.put((rank, got, os.sched_getaffinity(0) == before))


@pytest.mark.timeout(60)
def test_two_ranks_measure_round_trips_and_get_their_cpus_back(line_file):
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, line_file, 3, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict((r, (vals, kept)) for r, vals, kept in (out.get(timeout=30) for _ in procs))
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    for r in (0, 1):
        vals, kept = got[r]
        assert kept, f"rank {r} was left pinned"
        assert len(vals) == 3 and all(v is not None and 0 < v < 1e6 for v in vals), (r, vals)
    # every round trip in the file: rank 1 echoed the last of 3 probes' LINE_TRIES tries
    with open(line_file, "rb") as f:
        words = memoryview(f.read()).cast("Q")
    assert words[0] == words[8] == 3 * ranks.LINE_TRIES * ranks.LINE_EXCHANGES


@pytest.mark.timeout(30)
def test_a_partner_that_never_comes_costs_one_bounded_wait(line_file, monkeypatch):
    monkeypatch.setattr(ranks, "LINE_WAIT_S", 0.2)
    before = os.sched_getaffinity(0)
    probe = LineProbe(0, 2, line_file)
    t0 = time.monotonic()
    assert probe.probe() is None
    assert 0.2 <= time.monotonic() - t0 < 2.0
    assert os.sched_getaffinity(0) == before
    t0 = time.monotonic()
    assert probe.probe() is None and time.monotonic() - t0 < 0.05    # off for the job


def test_other_ranks_a_job_of_one_and_no_file_take_no_probe(line_file):
    assert LineProbe(2, 4, line_file).probe() is None
    assert LineProbe(0, 1, line_file).probe() is None
    assert LineProbe(1, 2, None).probe() is None
    with open(line_file, "rb") as f:
        assert f.read() == bytes(LINE_FILE_BYTES)     # none of them touched it


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "experiments", "line_distance.py")


@pytest.mark.timeout(120)
def test_line_distance_prints_each_block_and_parts_them_by_the_line_probe():
    import re
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, SCRIPT, "--systems", "hora", "--bytes", "64",
                           "--blocks", "4", "--calls", "20"], capture_output=True, text=True,
                          timeout=100, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    blocks = [ln.split() for ln in proc.stdout.splitlines() if re.match(r"^\s+\d+\s", ln)]
    assert [int(b[0]) for b in blocks] == [0, 1, 2, 3], proc.stdout
    times, lines = [float(b[1]) for b in blocks], [float(b[2]) for b in blocks]
    assert min(times) > 0 and min(lines) > 0
    # (the probes print to the ns: one printed as 700 may have been just below the split)
    near = [t for t, ns in zip(times, lines) if ns < 700]
    edge = sum(ns == 700 for ns in lines)
    summary = next(ln for ln in proc.stdout.splitlines() if "line probe below 700 ns" in ln)
    got = re.search(r"below 700 ns: (\S+) µs a call \(median of (\d+) blocks\); at or above "
                    r"it: (\S+) µs \(of (\d+)\)", summary)
    assert got, summary
    assert len(near) <= int(got[2]) <= len(near) + edge and int(got[2]) + int(got[4]) == 4
    if edge:
        return
    if near:        # (the blocks print to 0.1 µs)
        assert float(got[1]) == pytest.approx(statistics.median(near), abs=0.1)
    else:
        assert got[1] == "-"


def test_spearman_equals_scipys():
    np = pytest.importorskip("numpy")
    stats = pytest.importorskip("scipy.stats")
    import importlib.util
    spec = importlib.util.spec_from_file_location("line_distance", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rng = np.random.default_rng(3)
    for _ in range(5):
        a, b = rng.normal(size=30), rng.normal(size=30)
        b = b + a * rng.uniform(0, 2)
        assert mod.spearman(list(a), list(b)) == pytest.approx(stats.spearmanr(a, b)[0])
