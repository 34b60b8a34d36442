"""``hora bench`` output: the Markdown table, hora's target ratios, the limits, the plot.

``results[system][N]`` is a list of rows (``bytes``, ``time_s``, ``latency_us``,
``busbw_gbps``, ...) or ``{"error": text}``.  ``hora`` (the default data plane) is the
reference; the *peers* are the systems that are not hora.  Layer: bench.
"""
import os
import platform
import sys

import numpy as np

__all__ = ["REFERENCE", "peers", "print_table", "targets", "print_targets", "print_limits",
           "plot", "fmt_size", "untrusted", "WIDE_SPREAD", "print_spread_warnings",
           "SPEED_GAP", "speed_gap", "doubtful", "speed_note", "print_speed_warnings",
           "LINE_GAP", "line_gap", "line_note",
           "QUICK_NOTE"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
REFERENCE = "hora"
TARGET_BYTES = 64 * MiB     # the bandwidth targets are at this size ...
LATENCY_BYTES = 4           # ... and its latency target at this one
TARGET_NPS = (2, 4)         # the bandwidth targets' numbers of ranks
MPI = "mpi"                 # the latency and mid-size targets are against Open MPI
MID_SIZES = (16 * KiB, MiB)  # ... the mid sizes: this range, both ends included
# a figure whose rounds span more than this fraction of its median (max - min) cannot carry
# a ratio: the table marks its ratios with "?" and a warning names it
WIDE_SPREAD = 0.5
# two figures whose rounds' speed probes (the machine's speed for Python, their median)
# differ by more than this fraction were measured on what was, in effect, two machines: a
# ratio between them is marked "?" too, and a warning gives both figures' probes
SPEED_GAP = 0.2
# two figures whose rounds' line probes (the round trip of a word between two CPUs, their
# median) differ by more than this fraction moved their data across different distances (the
# host had put the guest's CPUs elsewhere): a ratio between them is marked "?" as well
LINE_GAP = 0.5
QUICK_NOTE = ("quick run: a smoke test of the benchmark (one launch, one short round, three "
              "sizes); its numbers are not for comparing systems, and no targets are given")


def peers(systems):
    """The systems hora is compared with: every one that is not hora itself."""
    return [s for s in systems if not s.startswith(REFERENCE)]


def fmt_size(nbytes):
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _fmt_us(us):
    return f"{us:.1f}" if us < 100 else f"{us:,.0f}"


def _fmt_gbps(x):
    return f"{x:.3f}" if x >= 0.01 else f"{x:.2g}"


def _row(results, system, n, nbytes):
    job = results.get(system, {}).get(n)
    if not isinstance(job, list):
        return None
    return next((r for r in job if r["bytes"] == nbytes), None)


def untrusted(row):
    """Whether ``row``'s rounds spread too wide for a ratio to mean much (WIDE_SPREAD)."""
    return row is not None and "min_s" in row and \
        (row["max_s"] - row["min_s"]) > WIDE_SPREAD * row["time_s"]


def _apart(a, b, key, gap):
    """Whether rows ``a`` and ``b``'s figures ``key`` differ by more than the fraction
    ``gap`` of the smaller; False where either row or figure is missing."""
    if a is None or b is None or key not in a or key not in b:
        return False
    lo, hi = sorted((a[key], b[key]))
    return hi > (1 + gap) * lo


def speed_gap(a, b):
    """Whether rows ``a`` and ``b`` were measured while the machine ran Python at speeds more
    than SPEED_GAP apart (the medians of their rounds' ``probe_us``); False where either has
    no probe."""
    return _apart(a, b, "probe_us", SPEED_GAP)


def line_gap(a, b):
    """Whether rows ``a`` and ``b`` were measured while a word took round trips between two
    CPUs more than LINE_GAP apart in time (the medians of their rounds' ``line_ns``); False
    where either has no line probe."""
    return _apart(a, b, "line_ns", LINE_GAP)


def doubtful(a, b):
    """Whether a ratio of rows ``a`` and ``b`` is marked "?": either spread too wide, or
    the two measured at different machine speeds, or with the CPUs at different
    distances."""
    return untrusted(a) or untrusted(b) or speed_gap(a, b) or line_gap(a, b)


def speed_note(first_us, second_us):
    """What a target line says of two figures measured at different machine speeds (their
    speed probes, in the target's order)."""
    return (f"measured at different machine speeds: speed probe {_fmt_us(first_us)} against "
            f"{_fmt_us(second_us)} us")


def line_note(first_ns, second_ns):
    """What a target line says of two figures measured with the CPUs at different distances
    (their line probes, in the target's order)."""
    return (f"measured with the CPUs at different distances: line probe {first_ns:.0f} "
            f"against {second_ns:.0f} ns")


def _latency_cell(row):
    if "min_s" not in row or len(row.get("rounds_s", ())) < 2:
        return _fmt_us(row["latency_us"])
    return (f"{_fmt_us(row['latency_us'])} ({_fmt_us(row['min_s'] * 1e6)}-"
            f"{_fmt_us(row['max_s'] * 1e6)})")


def print_table(results, systems, nps, sizes, out=sys.stdout):
    """One row per (size, N): each system's latency (median, and the min-max of its pooled
    rounds) and busbw, then t_peer / t_hora, marked "?" when either spread is too wide or
    the two ran at different machine speeds (:func:`speed_gap`)."""
    compared = peers(systems) if REFERENCE in systems else []
    head = ["size", "N"]
    for s in systems:
        head += [f"{s} latency (us)", f"{s} busbw (GB/s)"]
    head += [f"hora vs {p} (t_{p}/t_hora)" for p in compared]
    print("| " + " | ".join(head) + " |", file=out)
    print("|" + "|".join("---:" for _ in head) + "|", file=out)
    for size in sizes:
        for n in nps:
            cells = [fmt_size(size), str(n)]
            for s in systems:
                row = _row(results, s, n, size)
                cells += ([_latency_cell(row), _fmt_gbps(row["busbw_gbps"])] if row
                          else ["FAILED", "FAILED"] if n in results.get(s, {}) else ["-", "-"])
            mine = _row(results, REFERENCE, n, size)
            for p in compared:
                theirs = _row(results, p, n, size)
                mark = "?" if doubtful(mine, theirs) else ""
                cells.append(f"{theirs['time_s'] / mine['time_s']:.2f}x{mark}"
                             if mine and theirs else "-")
            print("| " + " | ".join(cells) + " |", file=out)


def print_spread_warnings(results, systems, nps, sizes, out=sys.stdout):
    """A line for each figure whose rounds spread too wide to trust a ratio with it."""
    said = False
    for s in systems:
        for n in nps:
            for size in sizes:
                row = _row(results, s, n, size)
                if untrusted(row):
                    if not said:
                        print(f"\nspread too wide to trust (rounds span more than "
                              f"{WIDE_SPREAD:.0%} of the median; ratios marked ?):", file=out)
                        said = True
                    print(f"- {s} N={n} {fmt_size(size)}: {_fmt_us(row['min_s'] * 1e6)}-"
                          f"{_fmt_us(row['max_s'] * 1e6)} us around {_fmt_us(row['latency_us'])}"
                          f" us, over {len(row['rounds_s'])} rounds", file=out)
    return said


def print_speed_warnings(results, systems, nps, sizes, out=sys.stdout):
    """A line for each (peer, N) whose rounds ran at another machine speed than hora's at
    some sizes (:func:`speed_gap`), naming the sizes and the two speeds; then the same for
    the distance between the CPUs (:func:`line_gap`)."""
    said = False
    compared = peers(systems) if REFERENCE in systems else []
    kinds = (
        (speed_gap, lambda r: _fmt_us(r["probe_us"]),
         f"the machine's speed differed between the systems' rounds (the speed probe, a fixed "
         f"loop of Python after each round, us, lower is faster; more than {SPEED_GAP:.0%} "
         f"apart: ratios marked ?):"),
        (line_gap, lambda r: f"{r['line_ns']:.0f}",
         f"the CPUs were at different distances for the systems' rounds (the line probe, the "
         f"round trip of a word between ranks 0 and 1 on two CPUs after each round, ns; more "
         f"than {LINE_GAP:.0%} apart: ratios marked ?):"))
    for gap, fmt, header in kinds:
        heard = False
        for p in compared:
            for n in nps:
                pairs = ((size, _row(results, REFERENCE, n, size), _row(results, p, n, size))
                         for size in sizes)
                gaps = [(size, m, t) for size, m, t in pairs if gap(m, t)]
                if not gaps:
                    continue
                if not heard:
                    print(f"\n{header}", file=out)
                    heard = said = True
                cells = ", ".join(f"{fmt_size(size)} {fmt(m)} against {fmt(t)}"
                                  for size, m, t in gaps)
                print(f"- hora vs {p} N={n}: {cells}", file=out)
    return said


# -- hora's targets -------------------------------------------------------------------------------
def _target(name, goal, value=None, why=None, detail="", rows=()):
    """One target; ``rows``: the results its value comes from (a wide spread in any of them
    marks it untrusted, as the table marks a ratio; a speed gap between the two it
    compares gives ``speeds``: their probes, in the order of ``rows``; a line gap gives
    ``lines``: their line probes)."""
    gap = len(rows) == 2 and speed_gap(*rows)
    far = len(rows) == 2 and line_gap(*rows)
    return {"name": name, "goal": goal, "value": value, "why_na": why, "detail": detail,
            "untrusted": any(untrusted(r) for r in rows),
            "speeds": [r["probe_us"] for r in rows] if gap else None,
            "lines": [r["line_ns"] for r in rows] if far else None}


def _busbw_ratio(results, n, name, goal, others, absent):
    """hora's busbw at TARGET_BYTES over the best of ``others`` that ran (or why not)."""
    rows = {p: _row(results, p, n, TARGET_BYTES) for p in others}
    rows = {p: r for p, r in rows.items() if r is not None}
    mine = _row(results, REFERENCE, n, TARGET_BYTES)
    if not any(p in results for p in others):
        return _target(name, goal, why=absent)
    if not any(_row(results, s, n, TARGET_BYTES) for s in results):
        return _target(name, goal, why=f"{fmt_size(TARGET_BYTES)} at N={n} was not measured "
                                       f"in this run")
    if not rows or mine is None:
        return _target(name, goal, why=absent if not rows else
                       f"hora has no {fmt_size(TARGET_BYTES)} N={n} result")
    best = max(rows, key=lambda p: rows[p]["busbw_gbps"])
    return _target(name, goal, mine["busbw_gbps"] / rows[best]["busbw_gbps"],
                   detail=f"hora {mine['busbw_gbps']:.3f} GB/s, {best} "
                          f"{rows[best]['busbw_gbps']:.3f} GB/s", rows=(mine, rows[best]))


def targets(results):
    """hora's target ratios from this run, each with its value or why it is n/a."""
    size = fmt_size(TARGET_BYTES)
    found = []
    for n in TARGET_NPS:
        found.append(_busbw_ratio(
            results, n, f"{size} busbw hora / best peer, N={n}", ">= 1.5x",
            peers(results), "no peer ran" if not peers(results)
            else f"no peer has a {size} N={n} result"))
    for n in TARGET_NPS:
        found.append(_busbw_ratio(
            results, n, f"{size} busbw hora / Horovod, N={n}", ">= 3x", ["horovod"],
            "Horovod did not run" if "horovod" not in results
            else f"Horovod has no {size} N={n} result"))
    found += _mpi_targets(results)
    name, goal = f"{LATENCY_BYTES} B latency hora-torch / gloo, N=2", "<= 0.5x"
    mine, theirs = (_row(results, s, 2, LATENCY_BYTES) for s in ("hora-torch", "gloo"))
    if mine and theirs:
        found.append(_target(name, goal, mine["time_s"] / theirs["time_s"],
                             detail=f"hora-torch {_fmt_us(mine['latency_us'])} us, gloo "
                                    f"{_fmt_us(theirs['latency_us'])} us",
                             rows=(mine, theirs)))
    else:
        missing = [s for s, r in (("hora-torch", mine), ("gloo", theirs)) if r is None]
        found.append(_target(name, goal, why=f"no {LATENCY_BYTES} B N=2 result for "
                                             f"{' and '.join(missing)}"))
    return found


def _mpi_targets(results):
    """Small and mid-size collectives against Open MPI (mpi4py) in the same run."""
    found = []
    absent = "Open MPI (mpi4py) did not run" if MPI not in results else None

    def latency(system, n, goal):
        name = f"{LATENCY_BYTES} B latency {system} / Open MPI, N={n}"
        mine, theirs = _row(results, system, n, LATENCY_BYTES), _row(results, MPI, n,
                                                                        LATENCY_BYTES)
        if absent or mine is None or theirs is None:
            return _target(name, goal, why=absent or f"no {LATENCY_BYTES} B N={n} result for "
                           f"{system if mine is None else 'Open MPI'}")
        return _target(name, goal, mine["time_s"] / theirs["time_s"],
                       detail=f"{system} {_fmt_us(mine['latency_us'])} us, Open MPI "
                              f"{_fmt_us(theirs['latency_us'])} us", rows=(mine, theirs))

    found += [latency("hora", 2, "<= 10x"), latency("hora-torch", 2, "<= 10x"),
              latency("hora", 4, "<= 5x")]
    lo, hi = MID_SIZES
    name = f"{fmt_size(lo)}-{fmt_size(hi)} busbw hora / Open MPI (worst size), N=2"
    pairs = _with_mpi(results, 2, lambda size: lo <= size <= hi)
    if absent or not pairs:
        found.append(_target(name, ">= 1x", why=absent or "no mid size measured for both"))
    else:
        size, m, t = min(pairs, key=lambda p: p[1]["busbw_gbps"] / p[2]["busbw_gbps"])
        found.append(_target(name, ">= 1x", m["busbw_gbps"] / t["busbw_gbps"],
                             detail=f"at {fmt_size(size)}: hora {m['busbw_gbps']:.3f} GB/s, "
                                    f"Open MPI {t['busbw_gbps']:.3f} GB/s", rows=(m, t)))
    name = "slowest size t_hora / t_Open MPI, N=4"
    pairs = _with_mpi(results, 4)
    if absent or not pairs:
        found.append(_target(name, "<= 2x", why=absent or "no N=4 size measured for both"))
    else:
        size, m, t = max(pairs, key=lambda p: p[1]["time_s"] / p[2]["time_s"])
        found.append(_target(name, "<= 2x", m["time_s"] / t["time_s"],
                             detail=f"at {fmt_size(size)}: hora {_fmt_us(m['latency_us'])} "
                                    f"us, Open MPI {_fmt_us(t['latency_us'])} us", rows=(m, t)))
    return found


def _with_mpi(results, n, keep=lambda size: True):
    """``[(size, hora's row, Open MPI's row)]`` at N=``n`` for the sizes both measured (and
    ``keep`` accepts), smallest first."""
    rows = results.get(REFERENCE, {}).get(n)
    out = []
    for mine in sorted(rows if isinstance(rows, list) else [], key=lambda r: r["bytes"]):
        theirs = _row(results, MPI, n, mine["bytes"])
        if theirs and keep(mine["bytes"]):
            out.append((mine["bytes"], mine, theirs))
    return out


def print_targets(found, out=sys.stdout):
    """The targets, a line each; a value from rounds spread too wide, or from two systems
    measured at different machine speeds or CPU distances, is marked ``?`` and says so, as
    in the table."""
    print("targets, from this run:", file=out)
    for t in found:
        if t["value"] is None:
            print(f"- {t['name']}: n/a ({t['why_na']}); target {t['goal']}", file=out)
            continue
        notes = ["rounds spread too wide to trust"] if t.get("untrusted") else []
        if t.get("speeds"):
            notes.append(speed_note(*t["speeds"]) + ", in that order")
        if t.get("lines"):
            notes.append(line_note(*t["lines"]) + ", in that order")
        note = "".join("; " + x for x in notes)
        print(f"- {t['name']}: {t['value']:.2f}x{'?' if notes else ''} ({t['detail']}{note}); "
              f"target {t['goal']}", file=out)


def print_limits(limits, out=sys.stdout):
    print(f"machine: {os.cpu_count()} CPUs, {platform.platform()}, Python "
          f"{platform.python_version()}, numpy {np.__version__}", file=out)
    size = fmt_size(limits["numpy_bytes"])
    print(f"- numpy copy (np.copyto, {size}): {limits['numpy_copy_gbps']:.2f} GB/s copied "
          f"(memory traffic is 2x)", file=out)
    print(f"- numpy add (np.add out=a, {size}): {limits['numpy_add_gbps']:.2f} GB/s of output "
          f"(memory traffic is 3x)", file=out)
    print(f"- shared memory, one process to another through /dev/shm "
          f"({fmt_size(limits['shm_bytes'])}): {limits['shm_gbps']:.2f} GB/s", file=out)
    print(f"- loopback TCP, one stream between two processes ({fmt_size(limits['tcp_bytes'])}):"
          f" {limits['tcp_stream_gbps']:.2f} GB/s", file=out)


def plot(results, systems, nps, path, limits=None):
    """Draw, into the PNG ``path``, the latency (us, log) and the bus bandwidth (GB/s, log)
    against size, one line per (system, N): hora's solid and thick, the peers thin and
    dashed; the machine's limits (``limits``, from :mod:`hora.bench.limits`) as horizontal
    lines on the bandwidth panel.

    Returns None, or why there is no plot (matplotlib missing, nothing measured).
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return "matplotlib is not installed (pip install 'hora[bench]')"
    lines = [(s, n, results[s][n]) for s in systems for n in nps
             if isinstance(results.get(s, {}).get(n), list) and results[s][n]]
    if not lines:
        return "no system has results"
    colors = {s: f"C{i % 10}" for i, s in enumerate(systems)}
    markers = ["o", "s", "^", "D"]
    fig, (lat, bw) = plt.subplots(1, 2, figsize=(15, 6))
    sizes = sorted({r["bytes"] for _, _, rows in lines for r in rows})
    for s, n, rows in lines:
        ours = s.startswith(REFERENCE)
        style = dict(color=colors[s], marker=markers[list(nps).index(n) % 4], markersize=3,
                     linewidth=2.2 if ours else 1.0, linestyle="-" if ours else "--",
                     alpha=1.0 if ours else 0.75, label=f"{s} N={n}")
        xs = [r["bytes"] for r in rows]
        lat.plot(xs, [r["latency_us"] for r in rows], **style)
        bw.plot(xs, [r["busbw_gbps"] for r in rows], **style)
    for name, key in (("numpy copy", "numpy_copy_gbps"), ("shared memory", "shm_gbps"),
                      ("loopback TCP stream", "tcp_stream_gbps")):
        if limits and limits.get(key):
            bw.axhline(limits[key], color="grey", linewidth=0.8, linestyle=":")
            bw.annotate(f"{name} {limits[key]:.1f} GB/s", (sizes[0], limits[key]),
                        fontsize="x-small", color="dimgrey", va="bottom")
    for ax in (lat, bw):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [fmt_size(x) for x in sizes], rotation=45)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
    lat.set_ylabel("latency (us, median)")
    lat.set_title("allreduce float32 Sum: time per call")
    bw.set_ylabel("bus bandwidth (GB/s)")
    bw.set_title("busbw = bytes / time x 2(N-1)/N; dotted: this machine's limits")
    bw.legend(fontsize="small", ncol=2)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return None
