"""``hora.metrics()``, the TensorBoard files rank 0 writes (read back with TensorBoard's own
reader), and ``hora.torch.average_metrics``, in real jobs.  The expected counts and bytes are
the script's own arithmetic."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hora.backends.board_segment import board_capacity
from tests.helpers import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIG = board_capacity(3) // 4 + 4096     # float32 elements: above the board's limit

JOB = """
import json, sys, time, numpy as np, hora
hora.init()
r = hora.rank()
def late():
    if r == 2:
        time.sleep(0.05)                                         # always the last
for i in range(20):
    late()
    hora.allreduce(np.ones(BIG, np.float32), name="big")        # the data plane
    late()
    hora.allreduce(np.ones(4, np.float32), name="small")        # blocking: the board
    late()
    hora.allgather(np.ones((r + 1, 3), np.float64), name="rows")
    time.sleep(0.03)
print("METRICS", json.dumps(hora.metrics()))
hora.shutdown()
"""


@pytest.mark.timeout(60)
def test_metrics_count_what_ran_and_rank0_writes_them_for_tensorboard(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB).replace("BIG", str(BIG)))
    logdir = tmp_path / "tb"
    env = dict(os.environ, HORA_METRICS_DIR=str(logdir), HORA_METRICS_PERIOD="0.5",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "hora", "run", "-np", "3", sys.executable,
                           str(script)], capture_output=True, text=True, timeout=50, env=env,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    got = {}
    for line in done.stdout.splitlines():
        if "METRICS " in line:
            rank = int(line[1:line.index("]")])
            got[rank] = json.loads(line.split("METRICS ", 1)[1])
    assert sorted(got) == [0, 1, 2]
    for rank, m in got.items():
        assert (m["rank"], m["size"]) == (rank, 3)
        assert m["collectives"] == {"allreduce": 40, "allgather": 20}
        assert m["bytes"]["allreduce"] == 20 * (BIG * 4 + 4 * 4)
        assert m["bytes"]["allgather"] == 20 * (rank + 1) * 3 * 8
        assert m["data_plane"] == {"shm": 20, "board": 20}
        assert m["fusion"]["buffers"] == 20 and m["fusion"]["tensors_per_buffer"] == 1.0
        assert m["fusion"]["fill"] == pytest.approx(BIG * 4 / (128 << 20))
        assert m["negotiation_ms"] > 0
        assert 0 < m["cache_hit_rate"] <= 1
    assert got[0]["stall_warnings"] == 0
    last = got[0]["last_to_arrive"]
    # rank 2 sleeps 0.05 s before every collective: it comes last to them (a margin of 5 of
    # the 60 for a loaded machine; when it came last to only a third of them, rank 0, busy
    # with the others' requests, could come last to as many), and the mean wait counts the
    # 0.05 s
    assert sum(last.values()) == 60 and last.get("2", 0) >= 55, last
    assert got[0]["wait_for_slowest_ms"] >= 50 * 55 / 60 * 0.8

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    final = {tag: acc.Scalars(tag)[-1].value for tag in acc.Tags()["scalars"]}
    for rank in range(3):
        assert final[f"hora/rank{rank}/collectives"] == 60
        assert final[f"hora/rank{rank}/megabytes"] == pytest.approx(
            sum(got[rank]["bytes"].values()) / 1e6, rel=1e-6)
    assert final["hora/collectives"] == 60
    assert final["hora/megabytes"] == pytest.approx(
        np.mean([sum(m["bytes"].values()) / 1e6 for m in got.values()]), rel=1e-6)
    assert len(acc.Scalars("hora/collectives")) >= 2          # written as the job ran
    assert "hora/rank0/wait_for_slowest_ms" in final


def _average_metrics():
    import torch
    import hora.torch as hvd
    rank = hvd.rank()
    values = {"loss": torch.tensor(float(rank) + 0.5), "acc": 0.25 * (rank + 1),
              "n": torch.tensor([rank * 10], dtype=torch.int64)}
    out = hvd.average_metrics(values)
    with pytest.raises(ValueError, match="'vec' has 2 elements"):
        hvd.average_metrics({"vec": torch.ones(2)})
    return {k: (v.tolist(), str(v.dtype)) if isinstance(v, torch.Tensor) else (v, "float")
            for k, v in out.items()}


@pytest.mark.timeout(60)
def test_average_metrics_is_the_mean_over_ranks():
    results = run_ranks(_average_metrics, 3, timeout_s=50)
    ranks = np.arange(3)
    for out in results:
        assert out["loss"] == (pytest.approx(float(np.mean(ranks + 0.5))), "torch.float32")
        assert out["acc"] == (pytest.approx(float(np.mean(0.25 * (ranks + 1)))), "float")
        assert out["n"] == ([int(np.mean(ranks * 10))], "torch.int64")
