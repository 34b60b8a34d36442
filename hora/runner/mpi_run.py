"""``hora run --mpi``: hand the launch to Open MPI's ``mpirun``, with the flags Horovod used.

    mpirun [--allow-run-as-root] --tag-output -np N -H a:4,b:4 --bind-to none --map-by slot
           --mca pml ob1 --mca btl ^openib [--mca btl_tcp_if_include IFACE ...]
           [--mca plm_rsh_args '-p PORT -i KEY'] -x VAR ... command

Binding is off (a data-parallel rank runs threads of its own), ranks fill each host's slots
in order (``-map-by slot``), and every variable of the job's environment is exported by
name only (``-x NAME``: mpirun reads the value from its own environment, so nothing secret
shows in ``ps``).  The workers then find their places from Open MPI's ``OMPI_COMM_WORLD_*``
variables and meet through mpi4py (see :mod:`hora.core.bootstrap`).

Layer: runner.
"""
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time

from ..errors import CollectiveTimeoutError, HoraError
from . import proc
from .hosts import resolve_hosts
from .launch import interface_list

__all__ = ["mpirun_command", "mpi_launch"]

log = logging.getLogger(__name__)

# this machine's or this login's: the remote ranks have their own (as for ssh)
_NOT_EXPORTED = {"HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "HOME", "USER", "LOGNAME", "MAIL",
                 "SHELL", "TERM", "DISPLAY", "TMUX", "TMUX_PANE", "SSH_AUTH_SOCK", "SSH_CLIENT",
                 "SSH_CONNECTION", "SSH_TTY", "XAUTHORITY"}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_STOP_GRACE_S = 5.0


def _exported(env):
    return sorted(k for k in env
                  if _NAME.match(k) and k not in _NOT_EXPORTED
                  and not k.startswith(("OMPI_", "PMIX_", "PRTE_", "XDG_", "BASH_FUNC_")))


def mpirun_command(command, np, hosts, env, ssh=None, network_interface=None,
                   output_filename=None, mpi_args=None, as_root=None):
    """The mpirun argv for a job (see the module docstring).

    Args:
        hosts: the job's :class:`~hora.runner.hosts.HostSpec` list.
        env: the environment mpirun will run with; each name in it is exported.
        ssh: :class:`~hora.runner.remote.SshSettings` (port and key become
            ``plm_rsh_args``; a command template becomes ``plm_rsh_agent``).
        as_root: add ``--allow-run-as-root`` (default: when running as root).
    """
    argv = ["mpirun"]
    if as_root if as_root is not None else os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    argv += ["--tag-output", "-np", str(np),
             "-H", ",".join(f"{h.hostname}:{h.slots}" for h in hosts),
             "--bind-to", "none", "--map-by", "slot", "--mca", "pml", "ob1",
             "--mca", "btl", "^openib"]
    if network_interface:
        argv += ["--mca", "btl_tcp_if_include", network_interface,
                 "--mca", "oob_tcp_if_include", network_interface]
    if ssh is not None:
        rsh = []
        if ssh.port is not None:
            rsh += ["-p", str(ssh.port)]
        if ssh.identity_file is not None:
            rsh += ["-i", os.fspath(ssh.identity_file)]
        if ssh.command is not None:
            argv += ["--mca", "plm_rsh_agent", ssh.command]
        if rsh:
            argv += ["--mca", "plm_rsh_args", " ".join(shlex.quote(a) for a in rsh)]
    if output_filename is not None:
        argv += ["--output-filename", os.fspath(output_filename)]
    if mpi_args:
        argv += shlex.split(mpi_args)
    for name in _exported(env):
        argv += ["-x", name]
    return argv + list(command)


def mpi_launch(command, np, hosts=None, hostfile=None, env=None, ssh=None,
               network_interface=None, start_timeout=None, timeout_s=None,
               output_filename=None, mpi_args=None):
    """Run ``command`` on ``np`` ranks under ``mpirun``; return mpirun's exit status.

    SIGINT/SIGTERM sent to this process are passed to mpirun, which stops its ranks.

    Raises:
        HoraError: mpirun is not installed.
        CollectiveTimeoutError: ``timeout_s`` passed (mpirun was stopped).
    """
    if shutil.which("mpirun") is None:
        raise HoraError("hora run --mpi needs Open MPI's mpirun on PATH: "
                        "pip install 'hora[mpi]' (or drop --mpi)")
    specs = resolve_hosts(np, hosts, hostfile)
    env = {**os.environ, **(env or {})}
    # Open MPI's own traffic may use every interface named (as under horovodrun --mpi);
    # hora's data plane binds the first
    nics = interface_list(network_interface)
    network_interface = ",".join(nics) or None
    if nics:
        env["HORA_IFACE"] = nics[0]
    if start_timeout is not None:
        env["HORA_START_TIMEOUT"] = repr(float(start_timeout))
    env.setdefault("PYTHONUNBUFFERED", "1")
    argv = mpirun_command(command, np, specs, env, ssh=ssh,
                          network_interface=network_interface,
                          output_filename=output_filename, mpi_args=mpi_args)
    log.info("running %s", shlex.join(argv))
    mpirun = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                              preexec_fn=proc.parent_death_hook())
    received = []
    restore = _forward_signals(mpirun, received)
    try:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while mpirun.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                _stop(mpirun)
                raise CollectiveTimeoutError(f"hora run --mpi: the job timed out after "
                                             f"{timeout_s:g} s; mpirun was stopped")
            try:
                mpirun.wait(0.1)
            except subprocess.TimeoutExpired:
                pass
        if received:
            return 128 + received[0]
        return proc.exit_status(mpirun.returncode)
    finally:
        restore()
        if mpirun.poll() is None:
            _stop(mpirun)


def _stop(mpirun):
    """SIGTERM mpirun (it tears its ranks down), SIGKILL its group after a grace period."""
    mpirun.terminate()
    try:
        mpirun.wait(_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.signal_group(mpirun.pid, signal.SIGKILL)
        mpirun.wait(_STOP_GRACE_S)


def _forward_signals(mpirun, received):
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def forward(signum, frame):
        received.append(signum)
        mpirun.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}

    def restore():
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
    return restore
