"""The TensorFlow 2 synthetic benchmark runs under ``hora run`` and reports img/sec: on hora
(2 ranks, and the synchronisation-only reference on 1) and on TensorFlow's
MultiWorkerMirroredStrategy (2 ranks); and the graph-mode cost benchmark prints its table
(1 rank).

Each TensorFlow process costs seconds of CPU to start, so each of the example's code paths
runs once: the script has no branch on the number of ranks (its report prints ``size``), so
hora on 2 ranks covers hora on 1; the synchronisation-only step (its own branch of the step
and of the report) runs on 1 rank, as the one allreduce inside a ``tf.function`` it adds is
the path test_tf_ops.py checks on 3 ranks."""
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

# TensorFlow is found, not imported: the ranks import it, this process needs none of it
if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("TensorFlow is not installed (pip install 'hora[tensorflow]')",
                allow_module_level=True)

from tests.helpers import TF_EXTRAS, without  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "examples" / "tensorflow2_synthetic_benchmark.py"
TINY = ["--model", "resnet8", "--batch-size", "4", "--num-warmup-batches", "1",
        "--num-batches-per-iter", "2", "--num-iters", "2"]


def hora_run(np_, script, *args, timeout=100):
    # on the CPU, as test_torch_examples: one GPU per local rank would fail on a machine
    # with fewer GPUs than ranks
    env = dict(os.environ, **without(TF_EXTRAS, {"CUDA_VISIBLE_DEVICES": "",
                                                 "TF_CPP_MIN_LOG_LEVEL": "2"}))
    run = subprocess.run([sys.executable, "-m", "hora", "run", "-np", str(np_), "--timeout",
                          str(timeout - 10), sys.executable, str(script), *args],
                         capture_output=True, text=True, timeout=timeout, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_, system", [(2, "hora"), (2, "mwms"), (1, "sync-only")])
def test_synthetic_benchmark_reports_img_per_sec(tmp_path, np_, system):
    result = tmp_path / "bench.json"
    flags = {"hora": [], "mwms": ["--use-mwms"], "sync-only": ["--sync-only"]}[system]
    out = hora_run(np_, BENCH, *TINY, "--no-cuda", "--json", str(result), *flags)
    assert re.search(r"^\[0\]<stdout>:Img/sec per CPU: [\d.]+ \+-[\d.]+$", out, re.M), out
    assert re.search(rf"^\[0\]<stdout>:Total img/sec on {np_} CPU\(s\): [\d.]+ \+-[\d.]+$",
                     out, re.M), out
    assert "[1]<stdout>:" not in out, out                     # rank 1 prints nothing
    name = {"mwms": "TensorFlow MultiWorkerMirroredStrategy", "hora": "hora",
            "sync-only": "hora, synchronisation only"}[system]
    assert f"Number of CPUs: {np_} ({name}, 1 thread(s) each)" in out, out
    report = json.loads(result.read_text())
    assert report["system"] == ("hora" if system == "sync-only" else system)
    assert report["size"] == np_ and report["sync_only"] == (system == "sync-only")
    assert report["model"] == "resnet8" and report["num_threads"] == 1
    assert len(report["img_sec_per_iter"]) == 2 and report["img_sec_total"] > 0
    assert len(report["batch_ends"]) == 4                      # 2 iterations of 2 batches


@pytest.mark.timeout(120)
def test_graph_cost_benchmark_prints_every_path(tmp_path):
    # one rank: the script times every path alike whatever N is (only the numbers change),
    # and a rank's collectives through TensorFlow on several ranks are test_tf_ops.py's
    out_json = tmp_path / "cost.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tf_graph_cost.py"),
                          "--np", "1", "--rounds", "1", "--round-s", "0.01", "--warmup", "2",
                          "--json", str(out_json)],
                         capture_output=True, text=True, timeout=110,
                         env=dict(os.environ, **without(TF_EXTRAS, {"CUDA_VISIBLE_DEVICES": "",
                                                                    "TF_CPP_MIN_LOG_LEVEL": "2"})))
    assert run.returncode == 0, run.stdout + run.stderr
    cell = r" \| ([\d.]+) \| ([\d.]+)x"                  # µs per call, ratio to numpy
    rows = re.findall(rf"^\| ([^|]+){cell * 3} \|$", run.stdout, re.M)
    assert [r[0] for r in rows] == ["numpy", "eager", "tf.function", "tf.function x8",
                                    "tf.function, no collective",
                                    "tf.function, numpy_function identity"], run.stdout
    assert rows[0][2] == rows[0][4] == rows[0][6] == "1.00"    # numpy against itself
    assert "| path | 4 B µs/call | 4 B vs numpy | 1 MiB µs/call |" in run.stdout, run.stdout
    assert json.loads(out_json.read_text())["np"] == 1
