"""``hora`` command line: argparse only; the work is done by :func:`hora.runner.launch`.

    hora run -np 4 -H host1:2,host2:2 python train.py
    hora run -np 2 --hostfile hosts.txt --output-filename logs/ python train.py
    hora run -np 8 -H a:4,b:4 --ssh-port 2222 --network-interface eth1 python train.py
    hora run --mpi -np 4 python train.py
    hora run -np 2 --backend tcp python train.py
    hora bench --quick

Layer: runner.
"""
import argparse
import functools
import logging
import sys

from ..config import env_value
from ..core import dataplane
from ..errors import CollectiveTimeoutError, HoraError
from . import bench
from .launch import launch
from .mpi_run import mpi_launch
from .remote import DEFAULT_CHECK_TIMEOUT_S, SshSettings

__all__ = ["main", "build_parser"]

EXIT_TIMEOUT = 124          # as timeout(1)
EXIT_CANNOT_START = 127     # as a shell for a command it cannot run
EXIT_USAGE = 2              # as argparse


def build_parser(extra_commands=()):
    """The ``hora`` argument parser (Horovod's ``horovodrun`` spellings are accepted).

    Args:
        extra_commands: callables ``add(subparsers)`` that register more subcommands, each
            setting a ``handler(args) -> exit status`` default (the higher layers' commands,
            e.g. ``hora k8s``, come in this way so that the runner never imports them).
    """
    parser = argparse.ArgumentParser(
        prog="hora", description="Distributed data-parallel training with Horovod's API.")
    commands = parser.add_subparsers(dest="subcommand", metavar="COMMAND")
    run = commands.add_parser(
        "run", help="launch a job of N processes",
        description="Run COMMAND as N processes; tag their output by rank; stop the whole "
                    "job when one fails.  Exits with the first failing process's status.")
    run.add_argument("-np", "--num-proc", dest="np", type=int, metavar="N",
                     help="number of processes (ranks); required unless an integration "
                          "supplies it (inside a SageMaker container: from its config)")
    where = run.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", dest="hosts", metavar="HOSTS",
                       help="host1:slots,host2:slots,... (default localhost:N)")
    where.add_argument("--hostfile", "-hostfile", dest="hostfile", metavar="FILE",
                       help="file of 'host slots=N' lines")
    run.add_argument("--output-filename", dest="output_filename", metavar="DIR",
                     help="also write each rank's output to DIR/rank.<r>/{stdout,stderr}")
    run.add_argument("--no-output-prefix", dest="prefix_output", action="store_false",
                     help="do not tag output lines with [<rank>]<stdout>:")
    run.add_argument("--start-timeout", dest="start_timeout", type=float, metavar="S",
                     help="seconds for every rank to reach hora.init() "
                          "(default: HORA_START_TIMEOUT or 30)")
    run.add_argument("--backend", dest="backend", choices=dataplane.BACKENDS,
                     help="data plane of the workers' collectives, as HORA_BACKEND (default: "
                          "HORA_BACKEND, else auto: shared memory on one host)")
    run.add_argument("--timeout", dest="timeout_s", type=float, metavar="S",
                     help="kill the job after S seconds (after dumping workers' tracebacks); "
                          f"exits {EXIT_TIMEOUT}")
    remote = run.add_argument_group("remote hosts")
    remote.add_argument("-p", "--ssh-port", dest="ssh_port", type=int, metavar="PORT",
                        help="ssh port of the remote hosts")
    remote.add_argument("-i", "--ssh-identity-file", dest="ssh_identity_file", metavar="FILE",
                        help="ssh private key for the remote hosts")
    remote.add_argument("--ssh-command", dest="ssh_command", metavar="TEMPLATE",
                        help="run remote commands with TEMPLATE instead of ssh: {host} is "
                             "replaced by the host (else appended), {command} by the shell "
                             "command (else appended), e.g. 'ip netns exec {host} sh -c "
                             "{command}'")
    remote.add_argument("--network-interface", "--network-interfaces", dest="iface",
                        metavar="IFACE", default=env_value("IFACE"),
                        help="interface the data plane binds to on every host (default: "
                             "HORA_IFACE, else the address each host reaches the launcher "
                             "from)")
    remote.add_argument("--check-timeout", dest="check_timeout", type=float, metavar="S",
                        default=DEFAULT_CHECK_TIMEOUT_S,
                        help="seconds for the start-up check of the remote hosts (default "
                             f"{DEFAULT_CHECK_TIMEOUT_S:g})")
    mpi = run.add_argument_group("mpirun")
    mpi.add_argument("--mpi", dest="use_mpi", action="store_true",
                     help="hand the launch to Open MPI's mpirun (with Horovod's flags)")
    mpi.add_argument("--mpi-args", dest="mpi_args", metavar="ARGS",
                     help="extra arguments for mpirun, as one string")
    run.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    run.set_defaults(handler=functools.partial(_run, parser=run))
    bench.add_command(commands)
    for add in extra_commands:
        add(commands)
    return parser


def _run(args, parser):
    """``hora run``: returns the job's exit status."""
    if not args.command:
        parser.error("hora run: no command given (e.g. hora run -np 2 python train.py)")
    if args.np is None:
        parser.error("hora run: the following arguments are required: -np/--num-proc")
    level = env_value("LOG_LEVEL").upper()
    logging.basicConfig(level=level if isinstance(logging.getLevelName(level), int) else "INFO",
                        stream=sys.stderr, format="[hora] %(levelname)s: %(message)s")
    # the launcher says where a multi-host job meets, whatever the level
    launch_log = logging.getLogger("hora.runner.launch")
    launch_log.setLevel(min(logging.INFO, logging.getLogger().getEffectiveLevel()))
    env = {"HORA_BACKEND": args.backend} if args.backend else None
    try:
        if args.use_mpi:
            return mpi_launch(args.command, args.np, hosts=args.hosts, hostfile=args.hostfile,
                              env=env,
                              ssh=_ssh_settings(args), network_interface=args.iface,
                              start_timeout=args.start_timeout, timeout_s=args.timeout_s,
                              output_filename=args.output_filename, mpi_args=args.mpi_args)
        return launch(args.command, args.np, hosts=args.hosts, hostfile=args.hostfile,
                      prefix_output=args.prefix_output, output_filename=args.output_filename,
                      timeout_s=args.timeout_s, start_timeout=args.start_timeout,
                      ssh=_ssh_settings(args), network_interface=args.iface,
                      check_timeout=args.check_timeout, env=env)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    except CollectiveTimeoutError:
        return EXIT_TIMEOUT            # the launcher already logged which ranks hung
    except HoraError as e:
        print(f"hora: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        print(f"hora: cannot start {args.command[0]!r}: {e}", file=sys.stderr)
        return EXIT_CANNOT_START


def _ssh_settings(args):
    return SshSettings(port=args.ssh_port, identity_file=args.ssh_identity_file,
                       command=args.ssh_command)


def main(argv=None, extra_commands=()):
    """Entry point of the ``hora`` console script and ``python -m hora``."""
    parser = build_parser(extra_commands)
    args = parser.parse_args(argv)
    if args.subcommand is None:
        parser.print_help()
        return 0
    return args.handler(args)
