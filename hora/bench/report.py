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
           "plot", "fmt_size"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
REFERENCE = "hora"
TARGET_BYTES = 64 * MiB     # the bandwidth targets are at this size ...
LATENCY_BYTES = 4           # ... and its latency target at this one
TARGET_NPS = (2, 4)         # the bandwidth targets' numbers of ranks


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


def print_table(results, systems, nps, sizes, out=sys.stdout):
    """One row per (size, N): each system's latency and busbw, then t_peer / t_hora."""
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
                cells += ([_fmt_us(row["latency_us"]), _fmt_gbps(row["busbw_gbps"])] if row
                          else ["FAILED", "FAILED"] if n in results.get(s, {}) else ["-", "-"])
            mine = _row(results, REFERENCE, n, size)
            for p in compared:
                theirs = _row(results, p, n, size)
                cells.append(f"{theirs['time_s'] / mine['time_s']:.2f}x" if mine and theirs
                             else "-")
            print("| " + " | ".join(cells) + " |", file=out)


# -- hora's targets -------------------------------------------------------------------------------
def _target(name, goal, value=None, why=None, detail=""):
    return {"name": name, "goal": goal, "value": value, "why_na": why, "detail": detail}


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
                          f"{rows[best]['busbw_gbps']:.3f} GB/s")


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
    name, goal = f"{LATENCY_BYTES} B latency hora-torch / gloo, N=2", "<= 0.5x"
    mine, theirs = (_row(results, s, 2, LATENCY_BYTES) for s in ("hora-torch", "gloo"))
    if mine and theirs:
        found.append(_target(name, goal, mine["time_s"] / theirs["time_s"],
                             detail=f"hora-torch {_fmt_us(mine['latency_us'])} us, gloo "
                                    f"{_fmt_us(theirs['latency_us'])} us"))
    else:
        missing = [s for s, r in (("hora-torch", mine), ("gloo", theirs)) if r is None]
        found.append(_target(name, goal, why=f"no {LATENCY_BYTES} B N=2 result for "
                                             f"{' and '.join(missing)}"))
    return found


def print_targets(found, out=sys.stdout):
    print("targets, from this run:", file=out)
    for t in found:
        if t["value"] is None:
            print(f"- {t['name']}: n/a ({t['why_na']}); target {t['goal']}", file=out)
        else:
            print(f"- {t['name']}: {t['value']:.2f}x ({t['detail']}); target {t['goal']}",
                  file=out)


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


def plot(results, systems, nps, path):
    """Draw busbw against size (log-log), one line per (system, N), into the PNG ``path``.

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
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(9, 6))
    for s, n, rows in lines:
        ax.plot([r["bytes"] for r in rows], [r["busbw_gbps"] for r in rows], marker="o",
                markersize=3, color=colors[s], linestyle=styles[list(nps).index(n) % 4],
                label=f"{s} N={n}")
    ax.set_xscale("log", base=2)
    sizes = sorted({r["bytes"] for _, _, rows in lines for r in rows})
    ax.set_xticks(sizes, [fmt_size(x) for x in sizes], rotation=45)
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title("allreduce float32 Sum: busbw = bytes / time x 2(N-1)/N")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small", ncol=2)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return None
