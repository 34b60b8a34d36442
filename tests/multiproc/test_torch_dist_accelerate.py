"""A Hugging Face Accelerate script on backend "hora" (issue 64, items 2 and 3), as a user runs
it: ``hora run --monitor --timeline-filename T -np 2 python accelerate_job.py`` on a
pseudo-terminal.  One job of 2 ranks (tests/multiproc/accelerate_job.py) trains with
Accelerate on hora, then on gloo, from the same seed on the same data; the tests read what it
left:

* its numbers: hora's run equals gloo's and one process's on the whole batch (this test
  trains that one itself), and Accelerate really ran a distributed job (DDP, the loader
  sharded by rank, ``gather`` in rank order);
* the timeline: a track per rank, holding the backend's calls by their names
  (``torch.<k>`` asynchronous, ``torch.sync`` blocking) and nothing of the gloo run;
* ``--monitor``: the table on the terminal, a row per rank, showing the backend's
  collectives.
"""
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

from tests.helpers import cached  # noqa: E402
from tests.multiproc import accelerate_job as job  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 1e-5                   # float32, summed in another order than one process does
LINGER_S = 2.0               # on hora after training: the monitor's table takes a new status
#                              once a second, a rank reports twice a second
# a collective of the backend as the monitor names it: its kind and hora's name for the call
BACKEND_CALL = re.compile(r"(allreduce|allgather|broadcast|barrier) torch\.(\d+|sync)")


# -- the job ----------------------------------------------------------------------------------
def _on_a_terminal(cmd, env, timeout_s):
    """Run ``cmd`` with its stdout and stderr on a pseudo-terminal of 160 x 40; return (exit
    status, all it wrote).  Past ``timeout_s`` its process group is killed and the test fails."""
    import fcntl
    import struct
    import termios
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                            start_new_session=True)
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:         # EIO: every writer closed the terminal
                    data = b""
                if not data:
                    break
                out += data
            elif proc.poll() is not None:
                break
        else:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            raise AssertionError(f"hora run still running after {timeout_s} s:\n"
                                 f"{_plain(bytes(out))[-3000:]}")
        return proc.wait(10), _plain(bytes(out))
    finally:
        os.close(master)


def _plain(raw):
    """The terminal's output without its control sequences (colours, cursor moves)."""
    return re.sub(r"\x1b\[[0-9;?]*[ -/]*[@-~]", "", raw.decode(errors="replace"))


def _run(tmp):
    trace = tmp / "timeline.json"
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]), TERM="xterm",
               OMP_NUM_THREADS="1")    # (unset, Accelerate sets torch's threads and warns)
    status, screen = _on_a_terminal(
        [sys.executable, "-m", "hora", "run", "--monitor", "--timeline-filename", str(trace),
         "-np", "2", sys.executable, job.__file__, str(tmp), "--linger", str(LINGER_S)],
        env, timeout_s=60)
    assert status == 0, f"hora run exited {status}:\n{screen[-3000:]}"
    ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(job.RANKS)]
    return ranks, json.loads(trace.read_text()), screen


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    jobs = {}
    tmp = tmp_path_factory.mktemp("accelerate")
    yield lambda: cached(jobs, "job", lambda: _run(tmp),
                         "the Accelerate job under hora run --monitor")


# -- one process on the whole batch -----------------------------------------------------------
def _one_process():
    """The parameters before and after :data:`job.STEPS` steps on the whole batch, and the
    loss of each rank's share of each step (rows of the batch in rank order) before it."""
    mse = torch.nn.functional.mse_loss
    model = job.Net()
    start = job.flat(model.parameters())
    opt = job.optimizer(model.parameters())
    _, x, y = job.data()
    batch = job.PER_RANK * job.RANKS
    losses = []
    for step in range(job.STEPS):
        xs, ys = x[step * batch:(step + 1) * batch], y[step * batch:(step + 1) * batch]
        with torch.no_grad():
            losses.append([mse(model(a), b).item()
                           for a, b in zip(xs.chunk(job.RANKS), ys.chunk(job.RANKS))])
        opt.zero_grad()
        mse(model(xs), ys).backward()
        opt.step()
    return start, job.flat(model.parameters()), losses


def _diff(a, b):
    return max(abs(p - q) for p, q in zip(a, b, strict=True))


# -- the tests --------------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_accelerate_on_hora_equals_gloo_and_one_process(ran):
    ranks, _, _ = ran()
    start, reference, losses = _one_process()
    assert _diff(start, reference) > 1e-2                # the steps moved the parameters
    for rank, res in enumerate(ranks):
        hora, gloo = res["hora"], res["gloo"]
        assert (hora["group"], gloo["group"]) == ("hora", "gloo"), rank
        assert _diff(hora["params"], gloo["params"]) < TOL, rank
        assert _diff(hora["params"], reference) < TOL, rank
        assert _diff(gloo["params"], reference) < TOL, rank
        assert hora["params"] == ranks[0]["hora"]["params"], f"rank {rank} differs"
        for run in (hora, gloo):
            got = [loss for step in run["losses"] for loss in step]
            assert _diff(got, [loss for step in losses for loss in step]) < TOL, (rank, run)


@pytest.mark.timeout(90)
def test_accelerate_runs_a_distributed_job_on_hora(ran):
    ranks, _, _ = ran()
    batch = job.PER_RANK * job.RANKS
    # step s: rank r's share is rows [batch*s + PER_RANK*r, ... + PER_RANK), gathered in rank
    # order, so the gathered indices are the step's batch
    seen = [list(range(step * batch, (step + 1) * batch)) for step in range(job.STEPS)]
    for rank, res in enumerate(ranks):
        for backend in ("hora", "gloo"):
            run = res[backend]
            assert run["distributed_type"] == "DistributedType.MULTI_CPU", (backend, run)
            assert (run["num_processes"], run["process_index"]) == (job.RANKS, rank), backend
            assert run["wrapped"] == "DistributedDataParallel", (backend, run["wrapped"])
            assert run["seen"] == seen, (backend, run["seen"])
            assert run["steps"] == job.STEPS * job.RANKS, (backend, run["steps"])  # reduce


def _tracks(events):
    """{rank: {track name: [span names]}} of a Chrome trace."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "thread_name"}
    out = {}
    for e in events:
        if e.get("ph") == "X":
            out.setdefault(e["pid"], {}).setdefault(names[(e["pid"], e["tid"])], []).append(
                e["name"])
    return out


@pytest.mark.timeout(90)
def test_the_timeline_holds_the_backends_calls_by_name(ran):
    _, events, _ = ran()
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    tracks = _tracks(events)
    assert sorted(tracks) == [0, 1]
    for rank, rows in tracks.items():
        sync = rows.pop("torch.sync", [])
        # blocking: accelerator.reduce (an all_reduce) and wait_for_everyone (a barrier)
        assert [p.split()[0] for p in sync] == ["ALLREDUCE", "BARRIER"], (rank, sync)
        kinds = {}
        for row, phases in rows.items():
            assert "QUEUE" in phases and "NEGOTIATE" in phases, (rank, row, phases)
            (op,) = [p.split()[0] for p in phases
                     if p.split()[0] in ("ALLREDUCE", "ALLGATHER", "BROADCAST")]
            kinds[op] = kinds.get(op, 0) + 1
        # the k-th asynchronous call is torch.<k> (fewer than 16 of them here), and the gloo
        # run added none: DDP's one bucket a step, gather's two allgathers a step, DDP's
        # broadcast of rank 0's parameters at the start
        calls = sum(kinds.values())
        assert calls < 16 and sorted(rows) == sorted(f"torch.{k}" for k in range(calls)), rows
        assert kinds["ALLREDUCE"] == job.STEPS, kinds
        assert kinds["ALLGATHER"] >= 2 * job.STEPS and kinds["BROADCAST"] >= 1, kinds


def _rows(screen, rank):
    """Every row the monitor drew for ``rank``: its cells."""
    out = []
    for line in re.split(r"[\r\n]", screen):
        at = line.find(f"│ rank {rank} (")
        if at >= 0:
            out.append([c.strip() for c in line[at:].strip().strip("│").split("│")])
    return out


@pytest.mark.timeout(90)
def test_the_monitor_shows_each_rank_and_the_backends_collectives(ran):
    pytest.importorskip("rich")
    _, _, screen = ran()
    assert "hora: job status" in screen, screen[-3000:]
    header = next((line for line in screen.splitlines() if "last collective" in line), "")
    assert [c.strip() for c in header.strip().strip("┃").split("┃")] == [
        "rank", "steps/s", "coll/s", "last collective", "plane", "negotiation ms", "state"]
    assert not _rows(screen, 2)
    for rank in range(job.RANKS):
        rows = _rows(screen, rank)
        assert rows, (rank, screen[-3000:])
        shown = [row[3] for row in rows if row[3] != "-"]
        assert shown and all(BACKEND_CALL.fullmatch(c) for c in shown), (rank, shown)
        # the last call on hora (wait_for_everyone), shown while the ranks linger
        assert "barrier torch.sync" in shown, (rank, shown)
        # a rate is of two statuses a second or more apart (there are: the ranks linger); it
        # counts the collectives between them, when the table showed the rank before any
        # (whether it did depends on how long Accelerator() took)
        rates = [float(row[2]) for row in rows if row[2] != "-"]
        assert rates, (rank, rows)
        if rows[0][3] == "-":
            assert max(rates) > 0, (rank, rows)
        assert all(row[6] == "running" or row[6].startswith("silent") for row in rows), rows
