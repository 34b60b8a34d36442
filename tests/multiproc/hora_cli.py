"""``hora run`` started as a user starts it (``python -m hora run``), for the launcher's tests
(test_launcher.py, test_launcher_stops.py)."""
import os
import subprocess
import sys
import textwrap

from tests.helpers import survivors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def assert_none_alive(marker, within_s=3.0):
    """No process with ``marker`` in its command line is alive ``within_s`` seconds from now."""
    left = survivors(marker, within_s)
    assert left == [], f"processes left alive: {left}"


def write_script(tmp_path, body):
    """``body`` (dedented) as ``tmp_path/worker.py``; returns its path."""
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def hora_env():
    """This process's environment with the repository first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def hora_cli(*args, timeout=40):
    """Run ``python -m hora ...``; returns the CompletedProcess (text output)."""
    return subprocess.run([sys.executable, "-m", "hora", *args], capture_output=True,
                          text=True, timeout=timeout, env=hora_env(), stdin=subprocess.DEVNULL)
