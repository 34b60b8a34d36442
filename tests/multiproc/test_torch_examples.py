"""The PyTorch examples run under ``hora run -np 2``: digits trains, checkpoints on rank 0
and resumes; the synthetic benchmark reports img/sec (with hora and with torch DDP; its
--sync-only reference on one rank)."""
import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def hora_run(np_, script, *args, timeout=80):
    # on the CPU: the examples pin one GPU per local rank, as Horovod's do, and a machine
    # with fewer GPUs than ranks (one GPU, two ranks) would fail them
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, "-m", "hora", "run", "-np", str(np_), "--timeout",
                          str(timeout - 10), sys.executable, str(EXAMPLES / script), *args],
                         capture_output=True, text=True, timeout=timeout, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def epochs_printed(out):
    return [int(m) for m in re.findall(r"^\[0\]<stdout>:epoch +(\d+) ", out, re.M)]


@pytest.mark.timeout(120)
def test_digits_trains_checkpoints_on_rank_0_and_resumes(tmp_path):
    ckpt = tmp_path / "ckpt" / "digits.pt"
    out = hora_run(2, "pytorch_digits.py", "--epochs", "2", "--checkpoint", str(ckpt))
    assert epochs_printed(out) == [1, 2], out
    assert "[1]<stdout>:" not in out, out                     # rank 1 prints nothing
    assert f"saved {ckpt}" in out
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["digits.pt"]   # no leftovers
    import torch
    assert torch.load(ckpt)["epoch"] == 2

    out = hora_run(2, "pytorch_digits.py", "--epochs", "4", "--checkpoint", str(ckpt))
    assert f"[0]<stdout>:resuming from {ckpt} after epoch 2" in out, out
    assert epochs_printed(out) == [3, 4], out
    assert "[1]<stdout>:" not in out, out
    state = torch.load(ckpt)
    assert state["epoch"] == 4
    assert state["test_acc"] > 0.9


@pytest.mark.timeout(120)
# --sync-only on one rank, as test_tf_examples.py runs it: its branch (one allreduce of the
# loss, no DistributedOptimizer) is the same code on any number of ranks, and the hora run
# checks the 2-rank report and that rank 1 prints nothing
@pytest.mark.parametrize("np_, system", [(2, "hora"), (2, "ddp"), (1, "sync-only")])
def test_synthetic_benchmark_reports_img_per_sec(tmp_path, np_, system):
    result = tmp_path / "bench.json"
    flags = {"hora": [], "ddp": ["--use-ddp"], "sync-only": ["--sync-only"]}[system]
    out = hora_run(np_, "pytorch_synthetic_benchmark.py", "--model", "resnet8",
                   "--batch-size", "4", "--num-warmup-batches", "1",
                   "--num-batches-per-iter", "2", "--num-iters", "2", "--json", str(result),
                   *flags)
    assert re.search(r"^\[0\]<stdout>:Img/sec per CPU: [\d.]+ \+-[\d.]+$", out, re.M), out
    assert re.search(rf"^\[0\]<stdout>:Total img/sec on {np_} CPU\(s\): ", out, re.M), out
    assert "[1]<stdout>:" not in out, out
    report = json.loads(result.read_text())
    assert report["system"] == ("hora" if system == "sync-only" else system)
    assert report["sync_only"] == (system == "sync-only") and report["size"] == np_
    assert len(report["img_sec_per_iter"]) == 2 and report["img_sec_total"] > 0


@pytest.mark.timeout(120)
def test_synthetic_benchmark_runs_on_horovod_itself(tmp_path):
    # the same script on horovod.torch (only where Horovod is installed: not in CI)
    pytest.importorskip("horovod.torch")
    result = tmp_path / "bench.json"
    proc = subprocess.Popen(["horovodrun", "-np", "2", "-H", "localhost:2", "--gloo",
                             sys.executable, str(EXAMPLES / "pytorch_synthetic_benchmark.py"),
                             "--use-horovod", "--model", "resnet8", "--batch-size", "4",
                             "--num-warmup-batches", "1", "--num-batches-per-iter", "2",
                             "--num-iters", "2", "--json", str(result)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)     # horovodrun and the ranks it started
        out, _ = proc.communicate(timeout=10)
        raise AssertionError(f"horovodrun still running after 100 s:\n{out[-4000:]}") from None
    assert proc.returncode == 0, out
    assert "Number of CPUs: 2 (Horovod" in out, out
    report = json.loads(result.read_text())
    assert report["system"] == "horovod" and report["size"] == 2


@pytest.mark.timeout(120)
def test_step_timing_splits_the_step_growth_from_1_to_2_ranks():
    script = EXAMPLES.parent / "benchmarks" / "step_timing.py"
    run = subprocess.run([sys.executable, str(script), "--np", "2", "--steps", "16",
                          "--warmup", "3", "--model", "resnet8", "--batch-size", "8"],
                         capture_output=True, text=True, timeout=110,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "-- 1 rank(s)" in out and "-- 2 rank(s)" in out
    assert re.findall(r"^rank (\d): forward\+backward", out, re.M) == ["0", "0", "1"]
    means = [float(m) for m in re.findall(r"^step: median [\d.]+ ms, mean ([\d.]+) ms", out, re.M)]
    head = re.search(r"mean step ([\d.]+) -> ([\d.]+) ms, scaling efficiency ([\d.]+)%", out)
    assert head, out
    one, two, efficiency = map(float, head.groups())
    assert [one, two] == means
    # the means are printed to 0.05 ms
    assert 100 * (one - 0.05) / (two + 0.05) - 0.05 <= efficiency
    assert efficiency <= 100 * (one + 0.05) / (two - 0.05) + 0.05
    rows = dict(re.findall(r"^\| ([^|]+) \| (-?[\d.]+) \| -?[\d.]+% \|$", out, re.M))
    assert len(rows) == 4, out
    # the parts account for the whole growth of the mean step (to the printed rounding)
    assert sum(map(float, rows.values())) == pytest.approx(two - one, abs=0.13)
