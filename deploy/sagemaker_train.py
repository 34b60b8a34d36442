"""``train`` in a hora image: run a SageMaker training job the way hora's integration does.

SageMaker starts the image once on every host as ``docker run IMAGE train`` and writes the
job's configuration under ``/opt/ml`` (``HORA_SAGEMAKER_ROOT`` elsewhere).  The program is
``HORA_TRAIN_COMMAND`` (default ``python /opt/ml/code/train.py``) followed by the job's
hyperparameters as ``--name value`` (those named ``sagemaker_*`` excepted), as SageMaker's
training toolkit passes them, and by this script's own arguments.

- Without SageMaker's MPI option: ``hora run PROGRAM`` with no ``-np``: every host starts
  its share of the ranks (``sagemaker_mpi_num_of_processes_per_host``, else one per GPU),
  rank 0 on the first host serves the rendezvous; no SSH between hosts.
- With it (``sagemaker_mpi_enabled``): the first host waits for the others' sshd, then runs
  ``hora run --mpi PROGRAM``, which runs mpirun over every host with
  ``sagemaker_mpi_custom_mpi_options``; every other host runs sshd and stays up while
  mpirun's daemon (``orted``/``prted``) runs on it, as SageMaker's toolkit does.

Exit status: the job's; 2 when this is not a SageMaker container.
"""
import json
import os
import shlex
import socket
import subprocess
import sys
import time

from hora.core.sagemaker import read_sagemaker_env
from hora.errors import SageMakerConfigError

_DAEMONS = ("orted", "prted")       # Open MPI 4's and 5's per-host daemon


def program(sm, env, extra=()):
    """The training command: HORA_TRAIN_COMMAND, the hyperparameters, ``extra``."""
    command = shlex.split(env.get("HORA_TRAIN_COMMAND")
                          or f"python {shlex.quote(str(sm.root / 'code' / 'train.py'))}")
    for name, value in sm.hyperparameters.items():
        if not name.startswith("sagemaker_"):
            command += [f"--{name}", value if isinstance(value, str) else json.dumps(value)]
    return command + list(extra)


def _seconds(env, name, default):
    try:
        return float(env.get(name) or default)
    except ValueError:
        raise SageMakerConfigError(f"{name}={env[name]!r}: expected seconds") from None


def _wait_for_ssh(hosts, timeout_s, port=22):
    """Wait until every host accepts connections on ``port``, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    for host in hosts:
        while True:
            try:
                socket.create_connection((host, port), timeout=2).close()
                break
            except OSError:
                if time.monotonic() >= deadline:
                    print(f"train: {host}:{port} does not answer after {timeout_s:g} s; "
                          f"starting mpirun anyway", file=sys.stderr, flush=True)
                    return
                time.sleep(1)


def _daemon_running(proc="/proc"):
    """Whether an ``orted``/``prted`` runs here (an exited one not yet reaped does not)."""
    for pid in os.listdir(proc):
        if pid.isdigit():
            try:
                with open(os.path.join(proc, pid, "stat")) as f:
                    stat = f.read()
            except OSError:
                continue
            # "pid (comm) state ...": comm may hold spaces and parentheses
            comm = stat[stat.find("(") + 1:stat.rfind(")")]
            state = stat[stat.rfind(")") + 2:][:1]
            if comm in _DAEMONS and state not in ("Z", "X"):
                return True
    return False


def _serve_mpi(env):
    """A host other than the first: sshd, then stay while mpirun's daemon runs here."""
    sshd = subprocess.Popen([os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                          "entrypoint.sh"), "sshd"], env=env)
    try:
        start = time.monotonic()
        started = _seconds(env, "HORA_SAGEMAKER_MPI_START_S", 1800)
        while not _daemon_running():
            if sshd.poll() is not None:
                print(f"train: sshd exited with status {sshd.returncode}", file=sys.stderr)
                return 1
            if time.monotonic() - start > started:
                print(f"train: mpirun did not reach this host in {started:g} s",
                      file=sys.stderr)
                return 1
            time.sleep(0.2)
        while _daemon_running():
            time.sleep(0.2)
        return 0
    finally:
        sshd.terminate()
        sshd.wait()


def main(argv):
    env = dict(os.environ)
    try:
        sm = read_sagemaker_env(env=env)
        if sm is None:
            print("train: not in a SageMaker training container (no "
                  "/opt/ml/input/config/resourceconfig.json); run a command instead",
                  file=sys.stderr)
            return 2
        command = program(sm, env, argv)
        if not sm.mpi_enabled:
            os.execvp("hora", ["hora", "run", *command])
        if sm.host_index != 0:
            return _serve_mpi(env)
        _wait_for_ssh(sm.hosts[1:], _seconds(env, "HORA_SAGEMAKER_SSH_WAIT_S", 300))
    except SageMakerConfigError as e:
        print(f"train: {e}", file=sys.stderr)
        return 2
    os.execvp("hora", ["hora", "run", "--mpi", *command])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
