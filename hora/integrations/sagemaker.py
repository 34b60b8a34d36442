"""SageMaker training containers: start this host's ranks, write the model from rank 0.

SageMaker runs a training image's entry point once on every host of the job.  Three ways to
run a hora script there, all reading the same configuration (:mod:`hora.core.sagemaker`):

- the script alone (``python train.py``): ``hora.init()`` makes one rank per host;
- ``hora run python train.py`` with no ``-np``: every host starts its share of
  ``hosts x processes_per_host`` ranks (``sagemaker_mpi_num_of_processes_per_host``, else one
  per GPU, else 1), the way SageMaker's own torchrun runner works: each rank gets the
  ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR`` contract, rank 0 on the first
  host serves the rendezvous, and no SSH is needed between hosts;
- SageMaker's MPI distribution (``sagemaker_mpi_enabled``): SageMaker's framework containers
  run ``mpirun`` themselves and ``hora.init()`` reads Open MPI's environment.  In a container
  of one's own (deploy/entrypoint.sh), ``hora run --mpi python train.py`` with no ``-np`` on
  the first host runs that ``mpirun`` (:func:`mpi_run_args`: every host with
  ``processes_per_host`` slots, SageMaker's network interface, and the job's
  ``sagemaker_mpi_custom_mpi_options``) while the other hosts serve sshd.

:func:`model_dir` / :func:`save_model` make rank 0 alone write to ``SM_MODEL_DIR``, which
SageMaker uploads when the job ends.

Layer: integrations.  Uses hora.runner's supervisor and worker contract, and hora.core's
reading of the SageMaker configuration.
"""
import functools
import hashlib
import logging
import shlex
import sys

from ..config import env_value
from ..core.sagemaker import DEFAULT_RENDEZVOUS_PORT, read_sagemaker_env, sagemaker_root
from ..errors import SageMakerConfigError
from ..runner.contract import torchrun_env
from ..runner.launch_config import script_command
from ..runner.output import OutputPump
from ..runner.supervisor import Ending, Supervisor

__all__ = ["host_ranks", "host_envs", "run_on_this_host", "mpi_run_args", "model_dir",
           "save_model", "add_command"]

log = logging.getLogger(__name__)

_GRACE_S = 3.0          # SIGTERM -> SIGKILL for the other ranks when one fails
_EXIT_TIMEOUT = 124     # as timeout(1)


def host_ranks(sm):
    """The global ranks that run on this host: hosts fill in order, each with
    ``processes_per_host`` ranks, up to ``num_processes`` in all."""
    per_host, total = sm.processes_per_host, sm.num_processes
    first = sm.host_index * per_host
    return list(range(first, min(first + per_host, total)))


def host_envs(sm, base_env, port=None):
    """The environment of each rank this host starts (``base_env`` plus the contract)."""
    ranks = host_ranks(sm)
    port = port or DEFAULT_RENDEZVOUS_PORT
    job = base_env.get("TRAINING_JOB_NAME") or "sagemaker"
    # every host derives the same secret without talking to the others; a secret the user
    # set (HORA_SECRET in the training job's environment) is passed on unchanged
    secret = base_env.get("HORA_SECRET") or hashlib.sha256(
        "|".join(["sagemaker", job, *sm.hosts]).encode()).hexdigest()
    return [torchrun_env(base_env, rank, sm.num_processes, local, len(ranks), sm.hosts[0],
                         port, sm.current_host, secret)
            for local, rank in enumerate(ranks)]


def run_on_this_host(command, root=None, env=None, port=None, timeout_s=None):
    """Start this host's ranks of a SageMaker job, wait, return the exit status.

    The first rank to fail stops the others on this host (SIGTERM, then SIGKILL); the other
    hosts' ranks notice the lost peer and fail in turn.  SIGINT, SIGTERM or SIGHUP sent to
    this process (SageMaker stopping the job) stops them the same way (status 128+signum).

    Args:
        command: the program and its arguments (a first word ``train.py`` runs with this
            Python, as in ``hora run``: :func:`hora.runner.launch_config.script_command`).
        root: the SageMaker base directory (default HORA_SAGEMAKER_ROOT or ``/opt/ml``).
        env: the base environment (default ``os.environ``).
        port: rendezvous port on the first host (default HORA_RENDEZVOUS_PORT or 29501).
        timeout_s: stop the ranks after this many seconds (exit status 124), or None.

    Raises:
        SageMakerConfigError: not in a SageMaker container, or its configuration is invalid.
    """
    import os
    env = dict(os.environ if env is None else env)
    sm = read_sagemaker_env(root, env)
    if sm is None:
        raise SageMakerConfigError(
            f"not in a SageMaker training container: "
            f"{sagemaker_root(root, env) / 'input/config/resourceconfig.json'} does not exist")
    port = port or (int(env["HORA_RENDEZVOUS_PORT"]) if env.get("HORA_RENDEZVOUS_PORT")
                    else None)
    envs = host_envs(sm, env, port)
    ranks = host_ranks(sm)
    log.info("SageMaker host %s (%d of %d): starting ranks %s of %d", sm.current_host,
             sm.host_index + 1, len(sm.hosts), ranks, sm.num_processes)
    if not ranks:
        return 0
    command = script_command([str(c) for c in command])     # as hora run's: train.py runs
    with Supervisor(_GRACE_S, output=OutputPump(sm.num_processes, prefix=True)) as supervisor:
        for rank, rank_env in zip(ranks, envs):
            supervisor.spawn(rank, sm.current_host, command, rank_env)
        outcome = supervisor.wait(timeout_s)
        if outcome.ending is Ending.TIMED_OUT:
            log.error("timed out after %g s; stopping this host's ranks", timeout_s)
            supervisor.stop()
            return _EXIT_TIMEOUT
        return outcome.exitcode


def mpi_run_args(sm, mpi_args=None, network_interface=None):
    """What ``hora run --mpi`` takes from SageMaker's MPI settings, as the toolkit's own
    ``mpirun`` does: ``(np, hosts, mpi_args, network_interface)``.

    ``hosts`` lists every host with ``processes_per_host`` slots (``algo-1:4,algo-2:4``);
    ``mpi_args`` is the given ``--mpi-args`` followed by ``sagemaker_mpi_custom_mpi_options``
    (later mpirun options win, so the job's own come last); the interface is SageMaker's
    unless one was given.

    Raises:
        SageMakerConfigError: the MPI settings are invalid, or this is not the first host
            (only the first host runs mpirun; the others serve sshd).
    """
    if sm.host_index != 0:
        raise SageMakerConfigError(
            f"hora run --mpi runs mpirun on the first host ({sm.hosts[0]}) only; on "
            f"{sm.current_host} serve sshd instead (deploy/entrypoint.sh does)")
    custom = sm.custom_mpi_options
    try:
        shlex.split(custom)
    except ValueError as e:
        raise SageMakerConfigError(f"hyperparameter sagemaker_mpi_custom_mpi_options="
                                   f"{custom!r}: {e}") from e
    hosts = ",".join(f"{h}:{sm.processes_per_host}" for h in sm.hosts)
    extra = " ".join(a for a in (mpi_args, custom) if a) or None
    return sm.num_processes, hosts, extra, network_interface or sm.network_interface


def model_dir(root=None):
    """``SM_MODEL_DIR`` (created if missing) on global rank 0; None on every other rank.

    Outside SageMaker it is ``<root>/model`` all the same; ``root`` defaults to
    HORA_SAGEMAKER_ROOT or ``/opt/ml``.

    Example:
        >>> path = hora.integrations.sagemaker.model_dir()      # doctest: +SKIP
        >>> if path is not None:
        ...     torch.save(model.state_dict(), path / "model.pt")
    """
    from ..core import state        # here: the `hora` command imports this module
    if state.is_initialized() and state.rank() != 0:
        return None
    import os
    from pathlib import Path
    sm = read_sagemaker_env(root)
    path = sm.model_dir if sm is not None else Path(
        os.environ.get("SM_MODEL_DIR") or sagemaker_root(root) / "model")
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_model(write, filename="model.pt", root=None):
    """Call ``write(path)`` on rank 0 only, with ``path`` = ``model_dir() / filename``.

    Returns:
        The path written on rank 0, None on the other ranks.
    """
    directory = model_dir(root)
    if directory is None:
        return None
    path = directory / filename
    write(path)
    return path


def add_command(subparsers):
    """Let ``hora run`` without ``-np`` take the job's shape from a SageMaker container."""
    run = subparsers.choices.get("run")
    if run is None:
        return
    run.set_defaults(handler=functools.partial(_run, original=run.get_default("handler"),
                                               parser=run))


def _run(args, original, parser):
    if args.np is not None or args.hosts is not None or args.hostfile is not None:
        return original(args)
    try:
        sm = read_sagemaker_env()
        if sm is not None and args.use_mpi:
            args.np, args.hosts, args.mpi_args, args.iface = mpi_run_args(
                sm, args.mpi_args, args.iface or env_value("IFACE"))
            return original(args)
    except SageMakerConfigError as e:
        print(f"hora: {e}", file=sys.stderr)
        return 2
    if sm is None:
        return original(args)       # reports the missing -np
    if not args.command:
        parser.error("no command given (e.g. hora run python train.py)")
    import os
    from ..runner.cli import prepare_launch
    try:
        # INFO: the log says which ranks this host starts
        env = {**os.environ, **prepare_launch(args, level="INFO")}
    except ValueError as e:
        print(f"hora: {e}", file=sys.stderr)
        return 2
    try:
        return run_on_this_host(args.command, env=env, timeout_s=args.timeout_s)
    except SageMakerConfigError as e:
        print(f"hora: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"hora: cannot start {args.command[0]!r}: {e}", file=sys.stderr)
        return 127
