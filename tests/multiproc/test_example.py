"""The README's main job: the distributed run matches a single process on the global batch."""
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("sklearn")
EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "numpy_digits.py"


@pytest.mark.timeout(90)
def test_two_ranks_train_exactly_like_one_process_on_the_global_batch(tmp_path):
    two, one = tmp_path / "two.npz", tmp_path / "one.npz"
    run = subprocess.run(
        [sys.executable, "-m", "hora", "run", "-np", "2", sys.executable, str(EXAMPLE),
         "--epochs", "3", "--batch-size", "16", "--lr", "0.05", "--checkpoint", str(two)],
        capture_output=True, text=True, timeout=80)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "[0]<stdout>:epoch  3" in run.stdout and "[1]<stdout>:epoch" not in run.stdout
    single = subprocess.run(
        [sys.executable, str(EXAMPLE), "--epochs", "3", "--batch-size", "32", "--lr", "0.1",
         "--checkpoint", str(one)], capture_output=True, text=True, timeout=60)
    assert single.returncode == 0, single.stderr
    a, b = np.load(two), np.load(one)
    for key in a.files:
        np.testing.assert_allclose(a[key], b[key], rtol=0, atol=1e-12, err_msg=key)
    assert float(a["test_acc"]) > 0.8
