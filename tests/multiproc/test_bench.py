"""``hora bench`` end to end: a real ``--quick`` run at N=2, its table, targets, JSON and plot.

The run is made once for the module (about 30 s on 2 busy cores); every number the tests
check in the printed table and targets is recomputed here from the JSON's raw rounds.  A
second run, of benchmarks/allreduce.py with several launches, shows that the documented
script is the same benchmark and that launches take turns.
"""
import importlib.util
import json
import os
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SYSTEMS = ["hora", "hora-tcp", "hora-mpi", "hora-torch", "gloo", "mpi", "horovod"]
QUICK_SIZES = [4, 16 << 10, 1 << 20]


def _hora(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "hora", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    json_path, png_path = str(out / "ar.json"), str(out / "ar.png")
    proc = _hora("bench", "--quick", "--np", "2", "--systems", *SYSTEMS,
                 "--json", json_path, "--plot", png_path)
    assert proc.returncode == 0, f"hora bench failed:\n{proc.stdout}\n{proc.stderr}"
    with open(json_path) as f:
        data = json.load(f)
    return proc, data, png_path


def _table(stdout):
    """The Markdown table as a list of {header: cell} dicts."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return head, [dict(zip(head, (c.strip() for c in ln.strip("|").split("|"))))
                  for ln in lines[2:]]


@pytest.mark.timeout(300)
def test_every_system_ran_or_says_why_not(quick):
    proc, data, _ = quick
    assert data["systems"] == [s for s in SYSTEMS if s not in data["skipped"]]
    assert set(data["skipped"]) <= set(SYSTEMS)
    assert {"hora", "hora-tcp"} <= set(data["systems"])
    for system, why in data["skipped"].items():
        assert f"skipping {system}: {why}" in proc.stderr
    if importlib.util.find_spec("torch") is not None:
        assert {"hora-torch", "gloo"} <= set(data["systems"])


@pytest.mark.timeout(300)
def test_rows_follow_from_the_raw_rounds(quick):
    _, data, _ = quick
    assert data["plan"]["sizes"] == QUICK_SIZES and data["plan"]["rounds"] == 1
    for system in data["systems"]:
        rows = data["results"][system]["2"]
        assert isinstance(rows, list), f"{system}: {rows}"
        assert [r["bytes"] for r in rows] == QUICK_SIZES
        for r in rows:
            t = statistics.median(r["rounds_s"])
            assert r["time_s"] == pytest.approx(t) and t > 0
            assert r["latency_us"] == pytest.approx(t * 1e6)
            assert r["busbw_gbps"] == pytest.approx(r["bytes"] / t / 1e9 * 2 * (2 - 1) / 2)
            assert (r["min_s"], r["max_s"]) == (min(r["rounds_s"]), max(r["rounds_s"]))
            assert r["min_s"] <= r["iqr_s"][0] <= t <= r["iqr_s"][1] <= r["max_s"]
            # the machine's speed after each round, one probe a round
            assert len(r["probes_us"]) == len(r["rounds_s"]) and min(r["probes_us"]) > 0
            assert r["probe_us"] == pytest.approx(statistics.median(r["probes_us"]))
            # and how far apart its CPUs were: ranks 0 and 1's round trips, on 2 CPUs or more
            if len(os.sched_getaffinity(0)) >= 2:
                assert len(r["lines_ns"]) == len(r["rounds_s"]), (system, r)
                assert min(r["lines_ns"]) > 0
                assert r["line_ns"] == pytest.approx(statistics.median(r["lines_ns"]))


@pytest.mark.timeout(300)
def test_table_has_every_system_and_the_ratios_to_each_peer(quick):
    proc, data, _ = quick
    head, rows = _table(proc.stdout)
    peers = [s for s in data["systems"] if not s.startswith("hora")]
    assert peers, "no peer ran: the ratio columns cannot be checked"
    for system in data["systems"]:
        assert f"{system} latency (us)" in head and f"{system} busbw (GB/s)" in head
    assert [c for c in head if c.startswith("hora vs ")] == [
        f"hora vs {p} (t_{p}/t_hora)" for p in peers]
    assert len(rows) == len(QUICK_SIZES)
    by_size = {r["bytes"]: r for r in data["results"]["hora"]["2"]}
    for row, nbytes in zip(rows, QUICK_SIZES):
        assert row["N"] == "2"
        for p in peers:
            theirs = next(r for r in data["results"][p]["2"] if r["bytes"] == nbytes)
            mine = by_size[nbytes]
            want = theirs["time_s"] / mine["time_s"]
            # "?": either figure's rounds span more than half its median, or the machine ran
            # Python more than a fifth slower for one of them (their median speed probes),
            # or a word took half as long again between its CPUs (their median line probes)
            wide = any(r["max_s"] - r["min_s"] > 0.5 * r["time_s"] for r in (mine, theirs))
            slow, fast = max(mine["probe_us"], theirs["probe_us"]), min(mine["probe_us"],
                                                                          theirs["probe_us"])
            lines = [r["line_ns"] for r in (mine, theirs) if "line_ns" in r]
            far = len(lines) == 2 and max(lines) > 1.5 * min(lines)
            doubt = wide or slow > 1.2 * fast or far
            assert row[f"hora vs {p} (t_{p}/t_hora)"] == f"{want:.2f}x" + ("?" if doubt else "")


@pytest.mark.timeout(300)
def test_a_quick_run_says_it_is_a_smoke_run_and_gives_no_targets(quick):
    proc, data, _ = quick
    # user-facing output states what it is, never the project's own bookkeeping
    assert "issue" not in (proc.stdout + proc.stderr).lower()
    assert "quick run: a smoke test of the benchmark" in proc.stdout
    assert "targets, from this run:" not in proc.stdout and data["targets"] == []
    # every figure's spread is in the table: the latency cell gives the rounds' min-max
    # only when there are several rounds (one here)
    head, rows = _table(proc.stdout)
    hora_4b = rows[0]["hora latency (us)"]
    assert "(" not in hora_4b


@pytest.mark.timeout(300)
def test_json_has_limits_versions_and_the_plot(quick):
    proc, data, png_path = quick
    limits = data["limits"]
    for key in ("numpy_copy_gbps", "numpy_add_gbps", "tcp_stream_gbps", "shm_gbps"):
        assert limits[key] > 0, key
    assert "shared memory, one process to another" in proc.stdout
    assert data["machine"]["hora"] and data["machine"]["numpy"]
    # which address layout hora's ranks had (it changes small collectives on crowded CPUs)
    assert data["machine"]["hora_rank_aslr"] == os.environ.get("HORA_RANK_ASLR",
                                                               "auto").lower()
    from hora.runner.proc import fixed_layout_refused
    assert data["machine"]["hora_rank_layout_refused"] == fixed_layout_refused()
    if importlib.util.find_spec("matplotlib") is None:
        assert data["plot"] is None and "no plot: matplotlib is not installed" in proc.stdout
        return
    assert data["plot"] == png_path
    with open(png_path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png_path) > 10_000


@pytest.fixture(scope="module")
def turns(tmp_path_factory):
    """One run of benchmarks/allreduce.py (the documented script) with three launches of
    two systems: the same run shows that the script is ``hora bench`` and that launches
    take turns, instead of a run of each."""
    json_path = str(tmp_path_factory.mktemp("turns") / "ar.json")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "allreduce.py"), "--np", "2",
         "--sizes", "4,64K", "--launches", "3", "--rounds", "2", "--round-s", "0.02",
         "--systems", "hora", "hora-tcp", "--no-limits", "--no-plot", "--json", json_path],
        capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    with open(json_path) as f:
        data = json.load(f)
    return proc, data


@pytest.mark.timeout(120)
def test_the_documented_script_is_the_same_benchmark(turns):
    _, data = turns
    for system in ("hora", "hora-tcp"):
        assert [r["bytes"] for r in data["results"][system]["2"]] == [4, 64 << 10]
    assert data["limits"] is None and data["plot"] is None


@pytest.mark.timeout(120)
def test_launches_take_turns_and_their_rounds_are_pooled(turns):
    proc, data = turns
    order = [ln.split(":")[0][len("[bench] "):] for ln in proc.stderr.splitlines()
             if ln.startswith("[bench] hora")]
    assert order == ["hora N=2 (1/3)", "hora-tcp N=2 (1/3)", "hora-tcp N=2 (2/3)",
                     "hora N=2 (2/3)", "hora N=2 (3/3)", "hora-tcp N=2 (3/3)"]
    assert data["plan"]["launches"] == 3 and data["plan"]["rounds"] == 2
    for system in ("hora", "hora-tcp"):
        for row in data["results"][system]["2"]:
            assert len(row["iters"]) == 3 and len(row["rounds_s"]) == 3 * 2
            assert len(row["probes_us"]) == 3 * 2
            assert row["time_s"] == pytest.approx(statistics.median(row["rounds_s"]))


@pytest.mark.parametrize("args, message", [
    (["--np", "1"], "every N must be at least 2"),
    (["--systems", "nccl-over-pigeons"], "invalid choice"),
    (["--max-size", "2"], "no sizes left"),
    (["--launches", "0"], "--launches must be positive"),
    (["--sizes", "4,12Q"], "bad size"),
])
def test_bad_arguments_are_usage_errors(args, message):
    proc = _hora("bench", *args, "--no-limits", timeout=60)
    assert proc.returncode == 2 and message in proc.stderr
