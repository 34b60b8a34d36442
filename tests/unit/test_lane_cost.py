"""benchmarks/experiments/lane_cost.py runs against the lane's path as it is: its stand-in
engine has every attribute that path reads (a path that reads a new one fails here first),
and it prints a row for the worker and one for rank 0."""
import os
import subprocess
import sys

import pytest

from hora.backends import board_segment as seg

pytestmark = pytest.mark.skipif(not seg.supported(), reason="the board needs x86-64 Linux")

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks", "experiments", "lane_cost.py")


@pytest.mark.parametrize("count", [1, 4])
def test_the_benchmark_runs_and_prints_both_ranks(count):
    done = subprocess.run([sys.executable, SCRIPT, "--no-valgrind", "--np", "3", "--count",
                           str(count)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rows = [ln.split("|") for ln in done.stdout.splitlines()
            if ln.startswith(("| 1 (a worker) |", "| 0 |"))]
    assert len(rows) == 2, done.stdout
    assert all(float(row[2]) > 0 for row in rows), done.stdout
