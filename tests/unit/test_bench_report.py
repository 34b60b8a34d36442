"""``hora bench``'s report from synthetic results: the targets against Open MPI, the spread
marks and warnings, and the two-panel plot."""
import io

import pytest

from hora.bench import report

KiB, MiB = 1 << 10, 1 << 20


def _rows(times_us, n, spread=0.0):
    """Rows as hora.bench.jobs makes them, from ``{bytes: median us}``."""
    rows = []
    for nbytes, us in sorted(times_us.items()):
        t = us * 1e-6
        rounds = [t * (1 - spread / 2), t, t * (1 + spread / 2)]
        algbw = nbytes / t / 1e9
        rows.append({"bytes": nbytes, "time_s": t, "latency_us": us, "algbw_gbps": algbw,
                     "busbw_gbps": algbw * 2 * (n - 1) / n, "rounds_s": rounds,
                     "min_s": min(rounds), "max_s": max(rounds), "iqr_s": [rounds[0],
                                                                            rounds[2]]})
    return rows


def _results(spread=0.0):
    sizes2 = {4: 20.0, 16 * KiB: 30.0, 256 * KiB: 100.0, MiB: 300.0, 64 * MiB: 10000.0}
    mpi2 = {4: 2.0, 16 * KiB: 15.0, 256 * KiB: 90.0, MiB: 200.0, 64 * MiB: 25000.0}
    sizes4 = {4: 40.0, 16 * KiB: 80.0, MiB: 700.0, 64 * MiB: 30000.0}
    mpi4 = {4: 10.0, 16 * KiB: 30.0, MiB: 300.0, 64 * MiB: 50000.0}
    return {"hora": {2: _rows(sizes2, 2, spread), 4: _rows(sizes4, 4)},
            "hora-torch": {2: _rows({4: 25.0}, 2)},
            "mpi": {2: _rows(mpi2, 2), 4: _rows(mpi4, 4)}}


def test_targets_against_open_mpi_follow_from_the_medians():
    found = {t["name"]: t for t in report.targets(_results())}
    assert found["4 B latency hora / Open MPI, N=2"]["value"] == pytest.approx(10.0)
    assert found["4 B latency hora-torch / Open MPI, N=2"]["value"] == pytest.approx(12.5)
    assert found["4 B latency hora / Open MPI, N=4"]["value"] == pytest.approx(4.0)
    # busbw ratio = t_mpi / t_hora; the worst of 16 KiB, 256 KiB and 1 MiB is 16 KiB: 0.5
    mid = found["16 KiB-1 MiB busbw hora / Open MPI (worst size), N=2"]
    assert mid["value"] == pytest.approx(15.0 / 30.0) and "at 16 KiB" in mid["detail"]
    slowest = found["slowest size t_hora / t_Open MPI, N=4"]
    assert slowest["value"] == pytest.approx(4.0) and "at 4 B" in slowest["detail"]
    assert found["64 MiB busbw hora / best peer, N=2"]["value"] == pytest.approx(2.5)


def test_targets_say_why_when_open_mpi_did_not_run():
    results = _results()
    del results["mpi"]
    found = [t for t in report.targets(results) if "Open MPI" in t["name"]]
    assert len(found) == 5
    assert all(t["value"] is None and t["why_na"] == "Open MPI (mpi4py) did not run"
               for t in found)


def test_wide_spreads_mark_the_ratios_and_are_named():
    out = io.StringIO()
    results = _results(spread=0.8)            # hora N=2: rounds span 80% of the median
    report.print_table(results, ["hora", "mpi"], [2], [4, 16 * KiB], out=out)
    table = out.getvalue()
    assert "| 20.0 (12.0-28.0) |" in table         # the spread in the latency cell
    assert "| 0.10x? |" in table and "| 0.50x? |" in table
    warn = io.StringIO()
    assert report.print_spread_warnings(results, ["hora", "mpi"], [2], [4], out=warn)
    assert "- hora N=2 4 B: 12.0-28.0 us around 20.0 us, over 3 rounds" in warn.getvalue()
    steady = io.StringIO()
    assert not report.print_spread_warnings(_results(), ["hora", "mpi"], [2], [4], out=steady)
    assert steady.getvalue() == ""


def _target_lines(results):
    """The printed target lines of ``results``, by their name (the text before ":")."""
    out = io.StringIO()
    report.print_targets(report.targets(results), out=out)
    return {line.split(":")[0]: line for line in out.getvalue().splitlines()}


def test_a_target_from_wide_rounds_is_marked_and_says_so():
    results = _results(spread=0.8)            # hora N=2 spreads wide; N=4 and Open MPI not
    found = {t["name"]: t for t in report.targets(results)}
    assert found["16 KiB-1 MiB busbw hora / Open MPI (worst size), N=2"]["untrusted"]
    assert found["4 B latency hora / Open MPI, N=2"]["untrusted"]
    assert not found["4 B latency hora / Open MPI, N=4"]["untrusted"]
    assert not found["4 B latency hora-torch / Open MPI, N=2"]["untrusted"]
    lines = _target_lines(results)
    assert lines["- 4 B latency hora / Open MPI, N=2"].startswith(
        "- 4 B latency hora / Open MPI, N=2: 10.00x? (hora 20.0 us, Open MPI 2.0 us; rounds "
        "spread too wide to trust); target <= 10x")
    assert "?" not in lines["- 4 B latency hora / Open MPI, N=4"]
    assert "too wide" not in lines["- 4 B latency hora / Open MPI, N=4"]


def _with_figure(results, system, n, key, value, others):
    """``results`` with every row of ``system`` at N=``n`` measured at ``value`` of the
    probe ``key`` (its median; ``key + "s"`` with the unit moved: its rounds), and every
    other row at ``others``."""
    one, unit = key.rsplit("_", 1)
    for s, by_n in results.items():
        for m, rows in by_n.items():
            for row in rows:
                v = value if (s, m) == (system, n) else others
                row.update({key: v, f"{one}s_{unit}": [v] * 3})
    return results


def _with_probes(results, system, n, probe_us):
    """``results`` with every row of ``system`` at N=``n`` measured at speed probe
    ``probe_us`` (and every other row at 10 us)."""
    return _with_figure(results, system, n, "probe_us", probe_us, 10.0)


def test_a_speed_gap_between_two_systems_marks_their_ratios_and_is_named():
    results = _with_probes(_results(), "hora", 4, 15.0)    # hora N=4 on a 1.5x slower machine
    assert report.speed_gap(results["hora"][4][0], results["mpi"][4][0])
    assert not report.speed_gap(results["hora"][2][0], results["mpi"][2][0])
    out = io.StringIO()
    report.print_table(results, ["hora", "mpi"], [2, 4], [4], out=out)
    cells = {line.split("|")[2].strip(): line.split("|")[-2].strip()
             for line in out.getvalue().splitlines()[2:]}
    assert cells == {"2": "0.10x", "4": "0.25x?"}       # t_mpi / t_hora: 2/20 and 10/40
    warn = io.StringIO()
    assert report.print_speed_warnings(results, ["hora", "mpi"], [2, 4], [4, 16 * KiB],
                                       out=warn)
    assert "- hora vs mpi N=4: 4 B 15.0 against 10.0, 16 KiB 15.0 against 10.0" in \
        warn.getvalue()
    assert "N=2" not in warn.getvalue()
    found = {t["name"]: t for t in report.targets(results)}
    assert found["4 B latency hora / Open MPI, N=4"]["speeds"] == [15.0, 10.0]
    assert found["4 B latency hora / Open MPI, N=2"]["speeds"] is None
    lines = _target_lines(results)
    assert lines["- slowest size t_hora / t_Open MPI, N=4"].startswith(
        "- slowest size t_hora / t_Open MPI, N=4: 4.00x? (at 4 B: hora 40.0 us, Open MPI "
        "10.0 us; measured at different machine speeds: speed probe 15.0 against 10.0 us")
    assert "?" not in lines["- 4 B latency hora / Open MPI, N=2"]


def test_speeds_within_the_gap_or_without_probes_mark_nothing():
    results = _with_probes(_results(), "hora", 4, 10.0 * (1 + report.SPEED_GAP) * 0.99)
    assert not report.speed_gap(results["hora"][4][0], results["mpi"][4][0])
    assert not report.print_speed_warnings(results, ["hora", "mpi"], [4], [4],
                                           out=io.StringIO())
    bare = _results()                           # rows from before the probe: no claim
    assert not report.speed_gap(bare["hora"][4][0], bare["mpi"][4][0])


def test_a_rounds_probe_is_its_slowest_ranks_and_the_launches_pool_them():
    from hora.bench.jobs import _summarize

    def rec(rounds_us, probes_us):
        return [{"bytes": 4, "iters": 10, "round_s": [t * 1e-6 for t in rounds_us],
                 "probe_us": probes_us}]
    # two launches of two ranks, two rounds each: per round, the slowest rank's figures
    launches = [[rec([10, 12], [8.0, 9.0]), rec([11, 11], [8.5, 13.0])],
                [rec([20, 21], [12.0, 14.0]), rec([19, 22], [11.0, 15.0])]]
    row, = _summarize(launches, 2)
    assert row["rounds_s"] == pytest.approx([11e-6, 12e-6, 20e-6, 22e-6])
    assert row["probes_us"] == [8.5, 13.0, 12.0, 15.0]
    assert row["probe_us"] == pytest.approx(12.5)
    old = [[[{"bytes": 4, "iters": 10, "round_s": [1e-5]}]]]    # ranks without the probe
    assert "probe_us" not in _summarize(old, 2)[0]


def _with_lines(results, system, n, line_ns):
    """``results`` with every row of ``system`` at N=``n`` measured at line probe
    ``line_ns`` (and every other row at 400 ns)."""
    return _with_figure(results, system, n, "line_ns", line_ns, 400.0)


def test_a_line_gap_between_two_systems_marks_their_ratios_and_is_named():
    # hora N=2 measured while a word took twice as long between the CPUs; speeds alike
    results = _with_lines(_with_probes(_results(), "hora", 2, 10.0), "hora", 2, 800.0)
    assert report.line_gap(results["hora"][2][0], results["mpi"][2][0])
    assert not report.line_gap(results["hora"][4][0], results["mpi"][4][0])
    assert not report.speed_gap(results["hora"][2][0], results["mpi"][2][0])
    out = io.StringIO()
    report.print_table(results, ["hora", "mpi"], [2, 4], [4], out=out)
    cells = {line.split("|")[2].strip(): line.split("|")[-2].strip()
             for line in out.getvalue().splitlines()[2:]}
    assert cells == {"2": "0.10x?", "4": "0.25x"}
    warn = io.StringIO()
    assert report.print_speed_warnings(results, ["hora", "mpi"], [2, 4], [4, MiB], out=warn)
    text = warn.getvalue()
    assert "the CPUs were at different distances" in text
    assert "- hora vs mpi N=2: 4 B 800 against 400, 1 MiB 800 against 400" in text
    assert "machine's speed differed" not in text and "N=4" not in text
    found = {t["name"]: t for t in report.targets(results)}
    assert found["4 B latency hora / Open MPI, N=2"]["lines"] == [800.0, 400.0]
    assert found["4 B latency hora / Open MPI, N=4"]["lines"] is None
    lines = _target_lines(results)
    assert lines["- 4 B latency hora / Open MPI, N=2"].startswith(
        "- 4 B latency hora / Open MPI, N=2: 10.00x? (hora 20.0 us, Open MPI 2.0 us; measured "
        "with the CPUs at different distances: line probe 800 against 400 ns, in that order)")
    within = _with_lines(_results(), "hora", 2, 400.0 * (1 + report.LINE_GAP) * 0.99)
    assert not report.line_gap(within["hora"][2][0], within["mpi"][2][0])
    assert not report.print_speed_warnings(within, ["hora", "mpi"], [2], [4],
                                           out=io.StringIO())


def test_a_rounds_line_probe_is_ranks_0_and_1s_larger_and_the_launches_pool_them():
    from hora.bench.jobs import _summarize

    def rec(rounds_us, lines_ns):
        return [{"bytes": 4, "iters": 10, "round_s": [t * 1e-6 for t in rounds_us],
                 "probe_us": [10.0] * len(rounds_us), "line_ns": lines_ns}]
    # ranks 2 and 3 take no line probe (None); a launch whose probe went off has none
    launches = [[rec([10, 12], [300.0, 900.0]), rec([11, 11], [350.0, 880.0]),
                 rec([9, 9], [None, None]), rec([9, 9], [None, None])],
                [rec([20, 21], [None, None]), rec([19, 22], [None, None]),
                 rec([9, 9], [None, None]), rec([9, 9], [None, None])]]
    row, = _summarize(launches, 4)
    assert row["lines_ns"] == [350.0, 900.0]
    assert row["line_ns"] == pytest.approx(625.0)
    assert len(row["rounds_s"]) == 4
    none = [[rec([10], [None]), rec([10], [None])]]
    assert "line_ns" not in _summarize(none, 2)[0]


def test_plot_has_a_latency_and_a_bandwidth_panel(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "ar.png"
    limits = {"numpy_copy_gbps": 8.0, "shm_gbps": 5.0, "tcp_stream_gbps": 2.0}
    assert report.plot(_results(), ["hora", "hora-torch", "mpi"], [2, 4], str(path),
                       limits) is None
    from matplotlib.image import imread
    height, width = imread(str(path)).shape[:2]
    assert width > 1.8 * height            # two panels side by side


def test_the_oversubscribed_note_says_how_horas_ranks_were_laid_out():
    from hora.bench.cli import _layout_note
    assert "share one address layout where they outnumber the CPUs (HORA_RANK_ASLR=auto)" \
        in _layout_note("auto")
    assert "randomized (HORA_RANK_ASLR=on)" in _layout_note("on")
    assert "share one address layout (HORA_RANK_ASLR=off)" in _layout_note("off")
    assert "the peers' ranks keep the system's randomization" in _layout_note("auto")
    # a machine that refuses the fixed layout (a container's seccomp profile) keeps it
    why = "personality(ADDR_NO_RANDOMIZE) is refused here (EPERM)"
    for policy in ("auto", "off"):
        note = _layout_note(policy, why)
        assert "each have an address layout of their own, randomized" in note, note
        assert why in note and f"(HORA_RANK_ASLR={policy})" in note, note
        assert "share one" not in note, note
    assert _layout_note("on", why) == _layout_note("on")
