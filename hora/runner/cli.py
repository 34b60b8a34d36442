"""``hora`` command line: argparse only; the work is done by :func:`hora.runner.launch`.

    hora run -np 4 -H host1:2,host2:2 python train.py
    hora run -np 2 --hostfile hosts.txt --output-filename logs/ python train.py
    hora run -np 8 -H a:4,b:4 --ssh-port 2222 --network-interface eth1 python train.py
    hora run --mpi -np 4 python train.py
    hora run -np 2 --backend tcp python train.py
    hora run -np 2 -- python train.py --lr 0.1
    hora run -np 2 train.py             # a .py first word runs with this Python

``hora run`` takes ``horovodrun``'s flags with their meaning, so that a Horovod job script
runs with ``horovodrun`` replaced by ``hora run``: the tuning and logging flags become the
workers' ``HORA_*`` settings; the elastic ones (``--min-np``, ``--max-np``,
``--host-discovery-script``, ...) run an elastic job (:mod:`hora.runner.elastic`).  A
setting a flag or the environment gives a value it does not accept, or a timeline file rank 0
could not write, stops ``hora run`` before any rank starts.

Layer: runner.
"""
import argparse
import difflib
import functools
import logging
import os
import sys

from ..config import (BACKENDS, LOG_LEVELS, MAX_SECONDS, check_settings, env_value,
                      log_level_number)
from ..errors import CollectiveTimeoutError, HoraError, SettingError
from ..version import __version__
from .elastic import ElasticJob, ElasticSettings
from .launcher import Job
from .launch_config import LaunchConfig
from .mpi_run import mpi_launch
from .remote import DEFAULT_CHECK_TIMEOUT_S, SshSettings

__all__ = ["main", "build_parser", "configure_launcher_logging", "prepare_launch",
           "launch_config"]

EXIT_TIMEOUT = 124          # as timeout(1)
EXIT_CANNOT_START = 127     # as a shell for a command it cannot run
EXIT_USAGE = 2              # as argparse

log = logging.getLogger(__name__)

# horovodrun's tuning flags that are hora settings too: (flag, type, metavar, HORA_* variable,
# how the value is written, help)
_SETTING_FLAGS = [
    ("--fusion-threshold-mb", int, "MB", "HORA_FUSION_THRESHOLD",
     lambda mb: str(mb * 1024 * 1024),
     "MB of allreduce tensors fused into one buffer; 0 disables fusion (default 128)"),
    ("--cycle-time-ms", float, "MS", "HORA_CYCLE_TIME", repr,
     "milliseconds a burst of requests is held to travel together (default 0)"),
    ("--cache-capacity", int, "N", "HORA_CACHE_CAPACITY", str,
     "response cache entries; 0 disables the cache (default 1024)"),
    ("--autotune-log-file", str, "FILE", "HORA_AUTOTUNE_LOG", str,
     "CSV file where rank 0 logs every autotune trial"),
    ("--autotune-warmup-samples", int, "N", "HORA_AUTOTUNE_WARMUP_SAMPLES", str,
     "autotune samples discarded at the start (default 3)"),
    ("--autotune-steps-per-sample", int, "N", "HORA_AUTOTUNE_STEPS_PER_SAMPLE", str,
     "allreduce batches in one autotune sample (default 10)"),
    ("--stall-check-warning-time-seconds", float, "S", "HORA_STALL_CHECK_TIME_SECONDS", repr,
     "seconds before a stall warning (default 60)"),
    ("--stall-check-shutdown-time-seconds", float, "S", "HORA_STALL_SHUTDOWN_TIME_SECONDS",
     repr, "seconds of stall before the job fails (default 0: never)"),
]


def _setting(kind, variable, write):
    """The argparse type of a flag that sets ``variable``: a ``kind`` whose written value
    the setting accepts (:mod:`hora.config` says what it accepts)."""
    def parse(text):
        value = kind(text)                  # a ValueError: argparse's "invalid int value"
        try:
            env_value(variable.split("_", 1)[1], {variable: write(value)})
        except SettingError as e:
            scaled = kind is int and e.value != text        # MB written as bytes
            raise argparse.ArgumentTypeError(
                f"{text!r} sets {e}" if scaled else f"expected {e.allowed}, got {text!r}") from e
        return value
    parse.__name__ = kind.__name__
    return parse


def _seconds(text):
    """The argparse type of a duration flag: seconds, above 0, at most MAX_SECONDS."""
    value = float(text)
    if not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0 and <= "
                                         f"{MAX_SECONDS:.0f}, got {text!r}")
    return value


_seconds.__name__ = "float"


class _Command(argparse.Action):
    """The program and its arguments, after an optional ``--`` that separates them from
    ``hora run``'s own flags."""

    def __call__(self, parser, namespace, values, option_string=None):
        values = list(values)
        setattr(namespace, self.dest, values[1:] if values[:1] == ["--"] else values)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that rejects an unknown option itself, with its own usage and the
    closest option it knows.

    A subcommand's parser otherwise hands unknown options up to ``hora``'s, whose error shows
    the top-level usage, which does not list them.
    """

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(self._unrecognized(extras))
        return namespace, extras

    def _unrecognized(self, extras):
        message = f"unrecognized arguments: {' '.join(extras)}"
        # argparse keeps its options in this private map, unchanged since Python 2.7
        known = list(self._option_string_actions)
        for extra in extras:
            if extra.startswith(tuple(self.prefix_chars)):
                close = difflib.get_close_matches(extra.split("=", 1)[0], known, n=1)
                if close:
                    return f"{message} (did you mean {close[0]}?)"
        return message


_RUN_DESCRIPTION = """\
Run COMMAND as N processes; tag their output by rank; stop the whole job when
one fails.  Exits with the first failing process's status.  horovodrun's flags
are accepted with their meaning.

A COMMAND whose first word ends in .py runs with this Python (the launcher's,
sys.executable, on every host), as torchrun runs its script, unless it is an
executable file with a #! line: `hora run -np 2 train.py` runs
`hora run -np 2 python train.py`."""

_RUN_EXAMPLES = """\
examples:
  hora run -np 4 python train.py              4 processes on this machine
  hora run -np 4 train.py --lr 0.1            the same, with this Python
  hora run -np 8 -H host1:4,host2:4 python train.py
                                              4 on each of two hosts (over ssh)
  hora run -np 8 --hostfile hosts.txt python train.py
  hora run -np 4 --min-np 2 --max-np 8 --host-discovery-script ./hosts.sh \\
      python train.py                         an elastic job
  hora run --mpi -np 4 python train.py        started by Open MPI's mpirun
  hora run -np 2 --timeline-filename t.json python train.py
                                              then `hora timeline t.json`"""

# torchrun's flags that have no meaning in hora run: each names what to write instead
_TORCHRUN_FLAGS = {
    ("--nproc-per-node", "--nproc_per_node"):
        "hora run takes -np N, the number of processes in all{example}; on several hosts "
        "give each host's slots with -H host1:N,host2:N or --hostfile",
    ("--nnodes",):
        "hora run takes the hosts with -H host1:slots,host2:slots or --hostfile, and -np, "
        "the number of processes in all",
}


class _TorchrunFlag(argparse.Action):
    """A torchrun flag given to ``hora run``: an error that says what ``hora run`` takes
    instead (as argparse's own errors: the usage, then the message, exit status 2)."""

    def __call__(self, parser, namespace, values, option_string=None):
        example = f" (here, -np {values} for one host)" if values.isdigit() else ""
        parser.error(f"{option_string} is torchrun's flag: {self.const.format(example=example)}")


def build_parser(extra_commands=()):
    """The ``hora`` argument parser (Horovod's ``horovodrun`` spellings are accepted).

    Args:
        extra_commands: callables ``add(subparsers)`` that register more subcommands, each
            setting a ``handler(args) -> exit status`` default (the commands beside or above
            the runner, ``hora bench`` and ``hora k8s``, come in this way so that the runner
            never imports them).
    """
    parser = _Parser(
        prog="hora", description="Distributed data-parallel training with Horovod's API.")
    parser.add_argument("--version", action="version", version=f"hora {__version__}")
    commands = parser.add_subparsers(dest="subcommand", metavar="COMMAND",
                                     parser_class=_Parser)
    run = commands.add_parser(
        "run", help="launch a job of N processes", description=_RUN_DESCRIPTION,
        epilog=_RUN_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_run_arguments(run)
    run.set_defaults(handler=functools.partial(_run, parser=run))
    for add in extra_commands:
        add(commands)
    return parser


def _add_run_arguments(run):
    run.add_argument("-np", "--np", "--num-proc", dest="np", type=int, metavar="N",
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
    run.add_argument("--start-timeout", dest="start_timeout", type=_seconds, metavar="S",
                     help="seconds for every rank to reach hora.init() "
                          "(default: HORA_START_TIMEOUT or 30)")
    run.add_argument("--backend", dest="backend", choices=BACKENDS,
                     help="data plane of the workers' collectives, as HORA_BACKEND (default: "
                          "HORA_BACKEND, else auto: shared memory on one host)")
    run.add_argument("--rank-aslr", dest="rank_aslr", choices=("auto", "on", "off"),
                     type=str.lower,
                     help="address-space randomization of the ranks, as HORA_RANK_ASLR: auto "
                          "(default) leaves it out on a machine that runs more ranks than it "
                          "has CPUs (ranks taking turns on a CPU run faster with one address "
                          "layout), on keeps it everywhere, off leaves it out everywhere")
    run.add_argument("--timeout", dest="timeout_s", type=_seconds, metavar="S",
                     help="kill the job after S seconds (after dumping workers' tracebacks); "
                          f"exits {EXIT_TIMEOUT}")
    run.add_argument("--monitor", dest="monitor", action="store_true",
                     help="on a terminal, a status line per rank (steps/s, last collective, "
                          "data plane, negotiation time, waiting or not) below the output")
    run.add_argument("--verbose", dest="verbose", action="store_true",
                     help="print the launcher's progress (hosts, ranks started, ...)")
    run.add_argument("--log-level", dest="log_level", type=str.upper, choices=LOG_LEVELS,
                     metavar="LEVEL",
                     help=f"level of hora's log, launcher and workers, as HORA_LOG_LEVEL: "
                          f"{', '.join(LOG_LEVELS)} (default: HORA_LOG_LEVEL or WARNING)")
    run.add_argument("--disable-cache", dest="disable_cache", action="store_true",
                     help="accepted for horovodrun's scripts: hora keeps no cache of its "
                          "host checks, it checks every launch")
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
                        action="append", metavar="IFACE",
                        help="interface the data plane binds to on every host (default: "
                             "HORA_IFACE, else the address each host reaches the launcher "
                             "from); of several (eth0,eth1 or the flag repeated), the first")
    remote.add_argument("--check-timeout", dest="check_timeout", type=_seconds, metavar="S",
                        default=DEFAULT_CHECK_TIMEOUT_S,
                        help="seconds for the start-up check of the remote hosts (default "
                             f"{DEFAULT_CHECK_TIMEOUT_S:g})")
    how = run.add_argument_group("launcher").add_mutually_exclusive_group()
    how.add_argument("--gloo", dest="use_gloo", action="store_true",
                     help="start the workers with hora's own launcher, as horovodrun --gloo "
                          "does with its own (the default)")
    how.add_argument("--mpi", dest="use_mpi", action="store_true",
                     help="hand the launch to Open MPI's mpirun (with Horovod's flags)")
    run.add_argument("--mpi-args", dest="mpi_args", metavar="ARGS",
                     help="extra arguments for mpirun (with --mpi), as one string")
    _add_tuning_arguments(run)
    _add_elastic_arguments(run)
    for flags, hint in _TORCHRUN_FLAGS.items():
        run.add_argument(*flags, action=_TorchrunFlag, const=hint, help=argparse.SUPPRESS)
    run.add_argument("command", nargs=argparse.REMAINDER, action=_Command,
                     help="the program and its arguments (after `--` if you like); a "
                          "first word ending in .py runs with this Python")


def _add_tuning_arguments(run):
    tuning = run.add_argument_group("tuning (each sets the workers' HORA_* setting)")
    tuning.add_argument("--autotune", dest="autotune", action="store_true",
                        help="tune the fusion threshold and cycle time online (HORA_AUTOTUNE)")
    for flag, kind, metavar, variable, write, text in _SETTING_FLAGS:
        tuning.add_argument(flag, dest=variable, type=_setting(kind, variable, write),
                            metavar=metavar, help=f"{text} ({variable})")
    tuning.add_argument("--no-stall-check", dest="no_stall_check", action="store_true",
                        help="turn the stall inspector off (HORA_STALL_CHECK_DISABLE)")
    tuning.add_argument("--timeline-filename", dest="timeline_filename", metavar="FILE",
                        help="rank 0 writes a Chrome trace of every rank's collectives to FILE "
                             "(HORA_TIMELINE; `hora timeline FILE` summarizes it)")


def _add_elastic_arguments(run):
    elastic = run.add_argument_group(
        "elastic training", "workers may fail, leave and join while the job runs (the "
        "script uses hvd.elastic.run); any of --min-np, --max-np or --host-discovery-script "
        "makes the job elastic")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int, metavar="N",
                         help="fewest workers the job runs with (default: -np)")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, metavar="N",
                         help="most workers the job runs with (default: -np without a "
                              "discovery script, else as many as the hosts have slots)")
    elastic.add_argument("--host-discovery-script", dest="discovery_script", metavar="SCRIPT",
                         help="command that prints the available hosts, host[:slots] a "
                              "line; run about once a second (excludes -H/--hostfile, "
                              "which give fixed hosts that may only shrink)")
    elastic.add_argument("--slots", "--slots-per-host", dest="slots", type=int, default=1,
                         metavar="N", help="slots of a discovered host whose line gives none "
                                           "(default 1)")
    elastic.add_argument("--reset-limit", dest="reset_limit", type=int, metavar="R",
                         help="stop the job after R resets (the job re-formed R times)")
    elastic.add_argument("--blacklist-cooldown-range", dest="cooldown", type=float, nargs=2,
                         metavar=("MIN", "MAX"),
                         help="a host whose worker failed gets new workers again after MIN "
                              "seconds, doubling with each failure, at most MAX (default: "
                              "never)")
    elastic.add_argument("--elastic-timeout", dest="elastic_timeout", type=_seconds,
                         metavar="S",
                         help="seconds to wait for --min-np workers before failing "
                              "(default: HORA_ELASTIC_TIMEOUT or 600)")


def _worker_settings(args):
    """The ``HORA_*`` variables the flags set for the workers."""
    env = {}
    if args.backend:
        env["HORA_BACKEND"] = args.backend
    if args.rank_aslr:
        env["HORA_RANK_ASLR"] = args.rank_aslr
    if args.log_level:
        env["HORA_LOG_LEVEL"] = args.log_level
    if args.autotune:
        env["HORA_AUTOTUNE"] = "1"
    if args.no_stall_check:
        env["HORA_STALL_CHECK_DISABLE"] = "1"
    if args.timeline_filename:
        env["HORA_TIMELINE"] = args.timeline_filename
    for _, _, _, variable, write, _ in _SETTING_FLAGS:
        value = getattr(args, variable)
        if value is not None:
            env[variable] = write(value)
    return env


_handler = None


def configure_launcher_logging(level):
    """Send the launcher's own messages to stderr as ``[hora] LEVEL: ...``, at ``level`` (one
    of :data:`hora.config.LOG_LEVELS`); for the commands that launch jobs.

    The handler belongs to this process's ``hora`` logger, which then stops propagating: the
    launcher runs no application code whose logging could print the same record again.
    """
    global _handler
    logger = logging.getLogger("hora")
    if _handler is None:
        _handler = logging.StreamHandler(sys.stderr)
        _handler.setFormatter(logging.Formatter("[hora] %(levelname)s: %(message)s"))
        logger.addHandler(_handler)
    logger.propagate = False
    number = log_level_number(level)
    logger.setLevel(number)
    # the launcher says where a multi-host job meets, whatever the level
    logging.getLogger("hora.runner.launcher").setLevel(min(logging.INFO, number))


def prepare_launch(args, level=None):
    """What every ``hora run`` does before it starts workers: configure the launcher's log
    and say what a flag will not do.

    Args:
        args: the parsed ``hora run`` arguments.
        level: the launcher's log level when neither ``--verbose`` nor ``--log-level`` is
            given (default: ``HORA_LOG_LEVEL``).

    Returns:
        The ``HORA_*`` variables the flags set for the workers.

    Raises:
        SettingError: a setting of the flags or of this environment (which the workers
            inherit) has a value it does not accept: it fails here, before any rank.
    """
    env = _worker_settings(args)
    check_settings({**os.environ, **env})
    from_env = env_value("LOG_LEVEL")
    if args.verbose:
        level = "DEBUG"
    elif args.log_level:
        level = args.log_level
    elif level is None:
        level = from_env
    configure_launcher_logging(level)
    return env


def _run(args, parser):
    """``hora run``: returns the job's exit status."""
    if not args.command:
        parser.error("no command given (e.g. hora run -np 2 python train.py)")
    elastic = _elastic_settings(args, parser)
    if args.np is None:
        if elastic is None:
            parser.error("the following arguments are required: -np/--num-proc")
        args.np = elastic.min_np
    try:
        env = prepare_launch(args)
    except SettingError as e:
        return _bad_setting(e, args)
    try:
        config = launch_config(args, env)
        if elastic is not None:
            if args.use_mpi:
                parser.error("elastic jobs run with hora's own launcher, not --mpi")
            if not (args.hosts or args.hostfile or args.discovery_script):
                config.check_timeline()     # every worker, rank 0 too, runs here
            return ElasticJob(config, elastic).run().exitcode
        if args.use_mpi:
            return mpi_launch(config, mpi_args=args.mpi_args)
        return Job(config).run().exitcode
    except SettingError as e:
        return _bad_setting(e, args)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    except CollectiveTimeoutError:
        return EXIT_TIMEOUT            # the launcher already logged which ranks hung
    except HoraError as e:
        print(f"hora: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        if e.filename is not None and os.fspath(e.filename) != args.command[0]:
            print(f"hora: {e}", file=sys.stderr)        # not the command: a path of ours
            return EXIT_USAGE
        print(f"hora: cannot start {args.command[0]!r}: {e}", file=sys.stderr)
        return EXIT_CANNOT_START


# the flags whose values become settings checked after parsing: variable -> (flag, dest)
_FLAG_OF = {"HORA_TIMELINE": ("--timeline-filename", "timeline_filename")}


def _bad_setting(error, args):
    """Say which setting (and which flag, if a flag set it) stops the job; the exit status."""
    flag, dest = _FLAG_OF.get(error.variable, (None, None))
    given = flag is not None and getattr(args, dest, None) is not None
    print(f"hora: {flag + ': ' if given else ''}{error}", file=sys.stderr)
    return EXIT_USAGE


def _elastic_settings(args, parser):
    """The :class:`~hora.runner.elastic.ElasticSettings` of the flags, or None for a fixed
    job."""
    if args.min_np is None and args.max_np is None and args.discovery_script is None:
        for flag, value in (("--reset-limit", args.reset_limit), ("--elastic-timeout",
                            args.elastic_timeout), ("--blacklist-cooldown-range", args.cooldown)):
            if value is not None:
                parser.error(f"{flag} is for elastic jobs: add --min-np/--max-np or "
                             f"--host-discovery-script")
        return None
    np = args.np
    min_np = args.min_np if args.min_np is not None else np
    if min_np is None:
        parser.error("an elastic job needs -np or --min-np")
    max_np = args.max_np
    if max_np is None and args.discovery_script is None:
        max_np = max(np or min_np, min_np)
    try:
        return ElasticSettings(
            min_np=min_np, max_np=max_np, discovery_script=args.discovery_script,
            slots=args.slots, reset_limit=args.reset_limit,
            cooldown=tuple(args.cooldown) if args.cooldown else None,
            timeout_s=(args.elastic_timeout if args.elastic_timeout is not None
                       else env_value("ELASTIC_TIMEOUT")))
    except ValueError as e:
        parser.error(str(e))


def launch_config(args, env):
    """The :class:`LaunchConfig` of parsed ``hora run`` arguments, with the workers'
    ``HORA_*`` settings ``env`` (:func:`prepare_launch`)."""
    return LaunchConfig(
        args.command, args.np, hosts=args.hosts, hostfile=args.hostfile, env=env,
        prefix_output=args.prefix_output, output_filename=args.output_filename,
        timeout_s=args.timeout_s, start_timeout=args.start_timeout,
        ssh=SshSettings(port=args.ssh_port, identity_file=args.ssh_identity_file,
                        command=args.ssh_command),
        network_interface=args.iface or env_value("IFACE"), check_timeout=args.check_timeout,
        monitor=args.monitor)


def main(argv=None, extra_commands=()):
    """Entry point of the ``hora`` console script and ``python -m hora``."""
    parser = build_parser(extra_commands)
    args = parser.parse_args(argv)
    if args.subcommand is None:
        parser.print_help()
        return 0
    return args.handler(args)
