"""A virtual environment of its own for the MXNet tests, made once and cached.

MXNet's last release (1.9.1) trains only with ``numpy<1.24``, which the rest of the suite
cannot use, so its tests run their workers with another interpreter: :func:`python` makes
(the first time) and returns ``~/.cache/hora/mxnet-<key>/bin/python``, a venv with
:data:`REQUIREMENTS`, where ``<key>`` hashes the requirements and this Python's version.  hora
itself is not installed there: the workers find it on ``PYTHONPATH`` (:func:`worker_env`).

The venv is built in a temporary folder beside its final place and renamed into it, under a
file lock, so that parallel test processes make it once and never see half of one.  Where it
cannot be made (no network, pip fails, pip runs past :data:`PIP_TIMEOUT_S`) the tests that
need it skip, naming the reason; the reason is kept for the rest of the session.  Tests
take the interpreter from the ``mxnet_python`` fixture, or call :func:`python` where a fixture
cannot reach (a job's runner).  ``HORA_TEST_CACHE`` moves the cache.
"""
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# mxnet 1.9.1 is the last release; numpy>=1.24 removed aliases (np.bool) it still uses
REQUIREMENTS = ["mxnet==1.9.1", "numpy==1.23.5", "scikit-learn", "cloudpickle>=2.0"]
PIP_TIMEOUT_S = 600
ROOT = Path(__file__).resolve().parent.parent          # the checkout: hora and tests/

_made = {}                                             # "python" or "reason" -> str


def cache_dir():
    """Where the venv lives: ``$HORA_TEST_CACHE`` or ``~/.cache/hora``."""
    return Path(os.environ.get("HORA_TEST_CACHE") or Path.home() / ".cache" / "hora")


def venv_path():
    key = "\n".join(REQUIREMENTS + [sys.version]).encode()
    return cache_dir() / f"mxnet-{hashlib.sha256(key).hexdigest()[:12]}"


def python():
    """The MXNet venv's interpreter, made if need be; skips the calling test where it
    cannot be made."""
    if "python" not in _made and "reason" not in _made:
        try:
            _made["python"] = str(_ensure(venv_path()))
        except _Unavailable as e:
            _made["reason"] = str(e)
    if "reason" in _made:
        pytest.skip(f"no MXNet venv: {_made['reason']}")
    return _made["python"]


@pytest.fixture(scope="session")
def mxnet_python():
    """The MXNet venv's interpreter (the test skips where there is none)."""
    return python()


def worker_env(extra=None):
    """Environment for processes of the MXNet venv: hora from this checkout, and that venv's
    packages before anything the launcher inherits from this process's path."""
    venv = Path(python()).parent.parent
    site = next(venv.glob("lib/python*/site-packages"))
    return {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
            "OMP_NUM_THREADS": "1", **(extra or {})}


def full_env():
    """This process's environment, for a command run with the MXNet venv's interpreter
    (``python -m hora run ...``): hora from this checkout on its path, nothing else."""
    python()
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


class _Unavailable(Exception):
    """The venv cannot be made; the message says why."""


def _ensure(final):
    exe = final / "bin" / "python"
    if exe.exists():
        return exe
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)               # another worker may be making it
        if exe.exists():
            return exe
        for stale in [final, *final.parent.glob(f"{final.name}.tmp-*")]:
            shutil.rmtree(stale, ignore_errors=True)     # a broken venv, a killed build
        tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=final.parent))
        try:
            _build(tmp)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return exe


def _build(where):
    """A venv at ``where`` with REQUIREMENTS, or _Unavailable.  The venv's scripts name
    ``where`` in their shebang lines; only its interpreter is used (``python -m``), which
    works from the final place."""
    steps = [("python -m venv", [sys.executable, "-m", "venv", str(where)], 120),
             ("pip install " + " ".join(REQUIREMENTS),
              [str(where / "bin" / "python"), "-m", "pip", "install", "--quiet", *REQUIREMENTS],
              PIP_TIMEOUT_S)]
    for what, cmd, limit in steps:
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=limit,
                                 stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise _Unavailable(f"{what} ran past its {limit} s limit") from None
        if run.returncode != 0:
            lines = [ln.strip() for ln in (run.stderr + run.stdout).splitlines() if ln.strip()]
            last = next((ln for ln in reversed(lines) if "ERROR" in ln),
                        lines[-1] if lines else "(no output)")
            raise _Unavailable(f"{what} failed (exit {run.returncode}): {last}")
