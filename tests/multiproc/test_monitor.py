"""``hora run --monitor`` on a real terminal: the job runs under tmux, and the screen
(``tmux capture-pane``) shows a status line per rank below the workers' output; without a
terminal the output is the job's alone."""
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

JOB = """
import time, torch, hora.torch as hvd
hvd.init()
model = torch.nn.Linear(10, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
for i in range(STEPS):
    opt.zero_grad()
    model(torch.ones(4, 10)).sum().backward()
    opt.step()
    if i % 10 == 0 and hvd.rank() == 0:
        print("step", i, flush=True)
    time.sleep(0.1)
hvd.shutdown()
"""


def _tmux():
    """tmux, installed with apt-get as root when missing (bounded); None if it cannot be."""
    if shutil.which("tmux") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        from tests import netns
        with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as log:
            netns._apt(["install", "--no-install-recommends", "tmux"], log,
                       time.monotonic() + 180)
    return shutil.which("tmux")


@pytest.mark.timeout(90)
def test_monitor_draws_a_line_per_rank_below_the_output_under_tmux(tmp_path):
    tmux = _tmux()
    if tmux is None:
        pytest.skip("tmux is not installed and could not be (needs root and apt-get)")
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB).replace("STEPS", "200"))
    session = f"hora-monitor-{uuid.uuid4().hex[:8]}"
    # the terminal's own size (not a COLUMNS this test's environment may carry)
    command = (f"cd {tmp_path} && unset COLUMNS LINES && PYTHONPATH={ROOT} {sys.executable} "
               f"-m hora run --monitor -np 2 {sys.executable} {script}; sleep 60")
    # a shell in a 170x40 terminal, and the command typed into it
    subprocess.run([tmux, "new-session", "-d", "-s", session, "-x", "170", "-y", "40", "sh"],
                   check=True, timeout=10)
    subprocess.run([tmux, "send-keys", "-t", session, command, "Enter"], check=True,
                   timeout=10)
    try:
        screen = ""
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            screen = subprocess.run([tmux, "capture-pane", "-p", "-t", session],
                                    capture_output=True, text=True, timeout=10).stdout
            rows = [line for line in screen.splitlines() if "rank 1 (" in line]
            if rows and "allreduce" in rows[-1] and "[0]<stdout>:step 20" in screen:
                break
            time.sleep(0.5)
        lines = screen.splitlines()
        assert any("hora: job status" in line for line in lines), screen
        header = next((line for line in lines if "steps/s" in line), None)
        assert header is not None, screen
        for column in ("rank", "steps/s", "coll/s", "last collective", "plane",
                       "negotiation ms", "state"):
            assert column in header, header
        for rank in (0, 1):
            (row,) = [line for line in lines if f"rank {rank} (" in line]
            cells = [c.strip() for c in row.strip("│ ").split("│")]
            assert float(cells[1]) > 2 and float(cells[2]) > 2, row     # ~10 steps/s
            assert cells[3].startswith("allreduce ") and cells[6] == "running", row
        # the workers' output scrolls above the table
        assert lines.index(next(line for line in lines if "[0]<stdout>:step 20" in line)) < \
            lines.index(header)
    finally:
        subprocess.run([tmux, "kill-session", "-t", session], timeout=10)


@pytest.mark.timeout(60)
def test_monitor_without_a_terminal_changes_nothing(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB).replace("STEPS", "12"))
    done = subprocess.run([sys.executable, "-m", "hora", "run", "--monitor", "-np", "2",
                           sys.executable, str(script)], capture_output=True, text=True,
                          timeout=50, env=dict(os.environ, PYTHONPATH=ROOT),
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[0]<stdout>:step 0", "[0]<stdout>:step 10"]
    assert "job status" not in done.stderr
