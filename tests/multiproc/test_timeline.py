"""The timeline with real jobs: ``hora run --timeline-filename`` (and HORA_TIMELINE,
``start_timeline``) writes one Chrome trace with a track per rank, on one clock, naming the
rank that came last; a job killed mid-run leaves a file that still loads; ``hora timeline``
summarizes it; with the timeline on, blocking small collectives still take the
shared-memory board (one span per round), and every collective has its operation phase."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from hora.core import timeline

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

JOB = """
import os, sys, time, numpy as np, hora
hora.init()
r = hora.rank()
wait = hora.synchronize                  # (asynchronous: the engine's path, not the board's)
for i in range(4):
    wait(hora.allreduce_async(np.full(200000, float(r), np.float32), name="big", op=hora.Sum))
    wait(hora.allgather_async(np.full((r + 1, 2), r, np.int32), name="rows"))
    wait(hora.broadcast_async(np.arange(8.0), root_rank=1, name="w"))
if r == 2:
    time.sleep(0.3)                      # rank 2 comes late to this one
wait(hora.allreduce_async(np.ones(4, np.float32), name="late"))
if os.environ.get("KILL_RANK0") and r == 0:
    time.sleep(1.5)                      # long enough for the events to reach the file
    os.kill(os.getpid(), 9)
hora.shutdown()
"""


def _run(tmp_path, script, *flags, env=None, np_=3):
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(script))
    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join([ROOT, full_env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "hora", "run", "-np", str(np_), *flags,
                           sys.executable, str(path)], capture_output=True, text=True,
                          timeout=50, env=full_env, stdin=subprocess.DEVNULL)


def _spans(events):
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
            if e.get("ph") == "M" and e["name"] == "thread_name"}
    out = {}
    for e in events:
        if e.get("ph") == "X":
            out.setdefault((e["pid"], rows[(e["pid"], e["tid"])]), []).append(e)
    return out


@pytest.mark.timeout(60)
def test_one_trace_with_every_rank_on_one_clock_and_the_late_rank_named(tmp_path):
    trace = tmp_path / "trace" / "timeline.json"
    done = _run(tmp_path, JOB, "--timeline-filename", str(trace))
    assert done.returncode == 0, done.stderr
    text = trace.read_text()
    events = json.loads(text)                    # complete: the closing bracket is there
    assert text.rstrip().endswith("]")
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    spans = _spans(events)
    for rank in range(3):
        phases = [e["name"] for e in spans[(rank, "big")]]
        assert phases.count("QUEUE") == 4 and phases.count("NEGOTIATE") == 4
        assert phases.count("PACK") == 4 and phases.count("UNPACK") == 4
        assert phases.count("ALLREDUCE shm") == 4, phases
        assert [e["name"] for e in spans[(rank, "rows")]].count("ALLGATHER") == 4
        assert [e["name"] for e in spans[(rank, "w")]].count("BROADCAST") == 4
        big = [e for e in spans[(rank, "big")] if e["name"] == "ALLREDUCE shm"]
        assert all(e["args"]["bytes"] == 800000 for e in big)
    # one clock: the same allreduce runs at the same time on every rank, so each rank's
    # span of it overlaps every other rank's
    runs = [sorted((e["ts"], e["ts"] + e["dur"]) for e in spans[(r, "big")]
                   if e["name"] == "ALLREDUCE shm") for r in range(3)]
    for i in range(4):
        starts, ends = zip(*(runs[r][i] for r in range(3)))
        assert max(starts) <= min(ends) + 1000, (i, starts, ends)     # within 1 ms
    # rank 0 saw rank 2 arrive last, about 0.3 s after the first
    (late,) = [e for e in spans[(0, "late")] if e["name"] == "NEGOTIATION"]
    assert late["args"]["last"] == 2
    assert late["args"]["arrived_ms"]["2"] >= 250, late
    assert late["dur"] >= 250000


@pytest.mark.timeout(60)
def test_a_killed_rank0_leaves_a_file_that_loads(tmp_path):
    trace = tmp_path / "timeline.json"
    done = _run(tmp_path, JOB, env={"HORA_TIMELINE": str(trace), "KILL_RANK0": "1"})
    assert done.returncode != 0
    text = trace.read_text()
    assert not text.rstrip().endswith("]")       # never closed
    events = timeline.load(str(trace))           # as Chrome's loader: the bracket optional
    assert json.loads(text + "\n]") == events
    assert any(e.get("name") == "ALLREDUCE shm" for e in events)


@pytest.mark.timeout(60)
def test_start_and_stop_timeline_with_marked_cycles(tmp_path):
    trace = tmp_path / "t.json"
    script = f"""
    import numpy as np, hora, hora.torch as hvd
    hora.init()
    hora.allreduce(np.ones(3, np.float32), name="before")
    hvd.start_timeline({str(trace)!r}, mark_cycles=True)
    hora.synchronize(hora.allreduce_async(np.ones(3, np.float32), name="during"))
    hvd.stop_timeline()
    hora.allreduce(np.ones(3, np.float32), name="after")
    hora.shutdown()
    """
    done = _run(tmp_path, script, np_=2)
    assert done.returncode == 0, done.stderr
    events = json.loads(trace.read_text())
    rows = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert "during" in rows and not rows & {"before", "after"}
    assert any(e.get("ph") == "i" and e["name"] == "CYCLE" for e in events)


@pytest.mark.timeout(60)
def test_hora_timeline_summarizes_and_plots(tmp_path):
    trace = tmp_path / "timeline.json"
    assert _run(tmp_path, JOB, "--timeline-filename", str(trace)).returncode == 0
    png = tmp_path / "where.png"
    out = subprocess.run([sys.executable, "-m", "hora", "timeline", str(trace), "--plot",
                          str(png)], capture_output=True, text=True, timeout=50,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    big = [line.split() for line in lines if line.startswith("big ")]
    by_phase = {" ".join(parts[1:-4]): int(parts[-4]) for parts in big}
    assert by_phase["ALLREDUCE shm"] == 12 and by_phase["QUEUE"] == 12       # 4 x 3 ranks
    assert any(line.strip().startswith("rank 2:") for line in lines)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


EVERY_KIND = """
import numpy as np, hora
hora.init()
r = hora.rank()
x = np.ones(1, np.float32)
for _ in range(300):                     # a loss's loop: blocking, 4 bytes
    hora.allreduce(x, name="loss", op=hora.Sum)
wait = hora.synchronize                  # (asynchronous: the engine's path)
wait(hora.allreduce_async(np.ones(2000, np.float32), name="small.async", op=hora.Sum))
wait(hora.allreduce_async(np.ones(50000, np.float32), name="big.async", op=hora.Sum))
hora.allreduce(np.ones(50000, np.float32), name="big", op=hora.Sum)
hora.allgather(np.full((r + 1, 2), r, np.int32), name="rows")
hora.broadcast(np.arange(4.0), root_rank=1, name="w")
wait(hora.broadcast_async(np.arange(4.0), root_rank=1, name="w.async"))
hora.alltoall(np.arange(4.0), name="a2a")
hora.reducescatter(np.ones(4, np.float32), name="rs", op=hora.Sum)
hora.barrier()
wait(hora.barrier_async())
hora.shutdown()
"""

# what a collective's span of its operation is called, by the kind that starts the name
_OPERATION = ("ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER", "BARRIER")


@pytest.mark.timeout(60)
def test_the_board_stays_on_and_every_collective_has_its_operation(tmp_path):
    trace = tmp_path / "timeline.json"
    done = _run(tmp_path, EVERY_KIND, "--timeline-filename", str(trace), np_=2)
    assert done.returncode == 0, done.stderr
    spans = _spans(json.loads(trace.read_text()))
    for rank in range(2):
        # the loop went through the board: a round each call, no request to rank 0
        loss = [e["name"] for e in spans[(rank, "loss")]]
        assert loss == ["ALLREDUCE board"] * 300, sorted(set(loss))
        assert all(e["args"]["bytes"] == 4 for e in spans[(rank, "loss")])
        # every collective the engine ran has its operation, as often as it was queued
        rows = {row: [e["name"] for e in events] for (pid, row), events in spans.items()
                if pid == rank}
        engine = {row for row, phases in rows.items() if "QUEUE" in phases}
        assert {"small.async", "big.async", "w.async", "a2a", "rs"} <= engine, rows
        for row, phases in rows.items():
            ops = [p for p in phases if p.split()[0] in _OPERATION]
            assert ops, (rank, row, phases)
            assert len(ops) >= phases.count("QUEUE"), (rank, row, phases)
        assert "ALLREDUCE rank 0" in rows["small.async"]     # (rank 0 reduced it)
        assert rows["big"] == ["ALLREDUCE board"]
        ops = {p for phases in rows.values() for p in phases if p.split()[0] in _OPERATION}
        assert {"ALLREDUCE board", "ALLREDUCE rank 0", "ALLGATHER board", "BROADCAST board",
                "BROADCAST", "ALLTOALL", "REDUCESCATTER", "BARRIER board",
                "BARRIER"} <= ops, ops
