"""``hora run --mpi``: hand the launch to Open MPI's ``mpirun``, with the flags Horovod used.

    mpirun [--allow-run-as-root] --tag-output -np N -H a:4,b:4 --bind-to none --map-by slot
           --mca pml ob1 --mca btl ^openib [--mca btl_tcp_if_include IFACE ...]
           [--mca plm_rsh_args '-p PORT -i KEY'] -x VAR ... command

Binding is off (a data-parallel rank runs threads of its own), ranks fill each host's slots
in order (``-map-by slot``), and every variable of the job's environment is exported by
name only (``-x NAME``: mpirun reads the value from its own environment, so nothing secret
shows in ``ps``).  ``--mpi-args`` come after these and replace those they name: hora leaves
out its ``--bind-to`` when the user's arguments give one (mpirun refuses an option given
twice), its ``--map-by`` when they map ranks in any way, its ``--mca pml`` when they set
``pml``, and so on.  The workers then find their places from Open MPI's ``OMPI_COMM_WORLD_*``
variables and meet through mpi4py (see :mod:`hora.core.bootstrap`).

Layer: runner.
"""
import logging
import os
import re
import shlex
import shutil
import subprocess

from ..errors import CollectiveTimeoutError, HoraError
from . import proc
from .contract import forwarded, job_env
from .hosts import is_local_host, resolve_hosts
from .launch_config import interface_list
from .supervisor import Ending, Supervisor, Worker

__all__ = ["mpirun_command", "mpi_launch"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# mpirun's options that place ranks: any one conflicts with another (Open MPI 5 turns the
# older ones into --map-by and refuses two); the user's replaces hora's --map-by slot
_MAPPING = frozenset({"map-by", "npernode", "pernode", "npersocket", "N", "bynode", "byslot",
                      "bysocket"})
# mpirun stops its ranks itself on SIGTERM; this long, then its process group is killed
_STOP_GRACE_S = 5.0


def _exported(env):
    """The names mpirun passes on (``-x``): the job's, not this machine's or Open MPI's own."""
    return sorted(k for k in forwarded(env)
                  if _NAME.match(k) and not k.startswith(("OMPI_", "PMIX_", "PRTE_")))


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
    argv += ["-np", str(np), "-H", ",".join(f"{h.hostname}:{h.slots}" for h in hosts)]
    user = shlex.split(mpi_args) if mpi_args else []
    given = _options(user)
    ours = [["--tag-output"], ["--bind-to", "none"], ["--map-by", "slot"],
            ["--mca", "pml", "ob1"], ["--mca", "btl", "^openib"]]
    if network_interface:
        ours += [["--mca", "btl_tcp_if_include", network_interface],
                 ["--mca", "oob_tcp_if_include", network_interface]]
    if ssh is not None:
        rsh = []
        if ssh.port is not None:
            rsh += ["-p", str(ssh.port)]
        if ssh.identity_file is not None:
            rsh += ["-i", os.fspath(ssh.identity_file)]
        if ssh.command is not None:
            ours.append(["--mca", "plm_rsh_agent", ssh.command])
        if rsh:
            ours.append(["--mca", "plm_rsh_args", " ".join(shlex.quote(a) for a in rsh)])
    if output_filename is not None:
        ours.append(["--output-filename", os.fspath(output_filename)])
    for option in ours:
        if not _options(option) & given:
            argv += option
    argv += user
    for name in _exported(env):
        argv += ["-x", name]
    return argv + list(command)


def _options(argv):
    """What the options of mpirun arguments ``argv`` set: an option's name, whatever its
    dashes (``bind-to``); ``mca <key>`` for an MCA parameter; ``map-by`` for every option
    that places ranks."""
    names, args = set(), iter(argv)
    for arg in args:
        if not arg.startswith("-"):
            continue
        name = arg.lstrip("-").split("=", 1)[0]
        if name in ("mca", "gmca"):
            names.add(f"mca {next(args, '')}")
            next(args, None)                # its value, which may start with a dash
        else:
            names.add("map-by" if name in _MAPPING else name)
    return names


def mpi_launch(config, mpi_args=None):
    """Run a job (a :class:`~hora.runner.launch_config.LaunchConfig`) under ``mpirun``;
    return mpirun's exit status.

    mpirun starts the ranks, forwards their output (``--tag-output``) and stops them; the
    :class:`~hora.runner.supervisor.Supervisor` watches mpirun alone: SIGINT, SIGTERM and
    SIGHUP sent to this process go to mpirun (not to its process group, where its local
    ranks may be), and what is left of the group after the grace period is killed.
    ``config``'s ``prefix_output``, ``grace_s``, ``store`` and ``check_timeout`` do not
    apply (mpirun has its own).

    Args:
        mpi_args: extra arguments for mpirun, as one string.

    Raises:
        HoraError: mpirun is not installed.
        SettingError: rank 0 runs on this machine and could not write the timeline file.
        CollectiveTimeoutError: ``config.timeout_s`` passed (mpirun was stopped).
        OSError: mpirun cannot be started.
    """
    if shutil.which("mpirun") is None:
        raise HoraError("hora run --mpi needs Open MPI's mpirun on PATH: "
                        "pip install 'hora[mpi]' (or drop --mpi)")
    specs = resolve_hosts(config.np, config.hosts, config.hostfile)
    if is_local_host(specs[0].hostname):
        config.check_timeline()             # rank 0 writes it here: fail before it starts
    # Open MPI's own traffic may use every interface named (as under horovodrun --mpi);
    # hora's data plane binds the first
    nics = interface_list(config.network_interface)
    env = job_env(os.environ, config.env, nics[0] if nics else None, config.start_timeout)
    argv = mpirun_command(config.command, config.np, specs, env, ssh=config.ssh,
                          network_interface=",".join(nics) or None,
                          output_filename=config.output_filename, mpi_args=mpi_args)
    log.info("running %s", shlex.join(argv))
    with Supervisor(_STOP_GRACE_S) as supervisor:
        mpirun = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                  start_new_session=True, preexec_fn=proc.parent_death_hook())
        supervisor.add(Worker(0, "localhost", mpirun, relay=_to_leader(mpirun), name="mpirun"))
        outcome = supervisor.wait(config.timeout_s)
        if outcome.ending is Ending.TIMED_OUT:
            supervisor.stop()
            raise CollectiveTimeoutError(f"hora run --mpi: the job timed out after "
                                         f"{config.timeout_s:g} s; mpirun was stopped")
        return outcome.exitcode


def _to_leader(popen):
    """Signals go to mpirun itself, which passes them to its ranks."""
    def relay(sig):
        popen.send_signal(sig)
        return True
    return relay
