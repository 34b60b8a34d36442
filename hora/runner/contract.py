"""The one writer of the worker environment: what every launcher of hora hands its workers.

- :func:`job_env`: the job-wide part, the same for every worker (the user's variables over
  the launcher's, the settings the launch options imply, unbuffered Python output);
- :func:`worker_env`: one rank's placement and rendezvous under ``HORA_*`` names, the
  placement also under ``horovodrun``'s ``HOROVOD_*`` names (``hora run``);
- :func:`torchrun_env`: one rank's placement under torchrun's names (``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``, ...), for hosts that each start their own share of a job
  without a launcher of ours above them (a SageMaker host);
- :func:`forwarded`: what of an environment travels to another machine (ssh, mpirun's
  ``-x``): not the variables that describe this machine or this login.

The names read on the worker side are declared in :mod:`hora.config`.

Layer: runner.  Imports nothing from hora.
"""
__all__ = ["job_env", "worker_env", "torchrun_env", "forwarded", "NOT_FORWARDED"]

# Variables that describe this machine or this login, not the job: a remote rank gets its
# own from its host and its login.
NOT_FORWARDED = frozenset({
    "HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "HOME", "USER", "LOGNAME", "MAIL", "SHELL",
    "TERM", "DISPLAY", "TMUX", "TMUX_PANE", "SSH_AUTH_SOCK", "SSH_CLIENT", "SSH_CONNECTION",
    "SSH_TTY", "XAUTHORITY"})
_NOT_FORWARDED_PREFIXES = ("XDG_", "BASH_FUNC_")

# a placement a worker must not inherit from the environment of whoever started its host's
# share of the job (torchrun's names are written over; these would be read first)
_INHERITED_PLACEMENT = ("HORA_RANK", "HORA_SIZE", "HOROVOD_RANK", "HOROVOD_SIZE")


def forwarded(env):
    """``env`` without the variables of this machine and this login."""
    return {k: v for k, v in env.items()
            if k not in NOT_FORWARDED and not k.startswith(_NOT_FORWARDED_PREFIXES)}


def job_env(base, extra=None, network_interface=None, start_timeout=None):
    """The environment every worker of a job shares.

    Args:
        base: the launcher's environment (``os.environ``).
        extra: the user's variables and the flags' ``HORA_*`` settings, over ``base``.
        network_interface: the interface the data plane binds to (``HORA_IFACE``), or None.
        start_timeout: seconds for every rank to reach ``hora.init()``
            (``HORA_START_TIMEOUT``), or None for the workers' default.
    """
    env = {**base, **(extra or {})}
    if network_interface:
        env["HORA_IFACE"] = network_interface
    if start_timeout is not None:
        env["HORA_START_TIMEOUT"] = repr(float(start_timeout))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def worker_env(slot, base_env, addr, port, secret, job_id, torch_store=None):
    """The environment of one worker: ``base_env`` plus the ``HORA_*`` contract.

    The placement is also written under ``horovodrun``'s names (``HOROVOD_RANK``, ...,
    ``HOROVOD_HOSTNAME``), which Horovod scripts and their test suites read.

    Args:
        slot: the rank's :class:`~hora.runner.hosts.SlotInfo`.
        base_env: the job's environment (:func:`job_env`).
        addr, port, secret, job_id: the job's rendezvous and identity.
        torch_store: ``(address, port)`` where rank 0 serves torch.distributed's store
            (``MASTER_ADDR``, ``MASTER_PORT``, unless ``base_env`` has them), so that
            ``dist.init_process_group()`` finds it as under torchrun.
    """
    env = dict(base_env)
    placement = {
        "RANK": str(slot.rank), "SIZE": str(slot.size),
        "LOCAL_RANK": str(slot.local_rank), "LOCAL_SIZE": str(slot.local_size),
        "CROSS_RANK": str(slot.cross_rank), "CROSS_SIZE": str(slot.cross_size),
        "HOSTNAME": slot.hostname,
    }
    for name, value in placement.items():
        env[f"HORA_{name}"] = env[f"HOROVOD_{name}"] = value
    env.update({
        "HORA_RENDEZVOUS_ADDR": addr, "HORA_RENDEZVOUS_PORT": str(port),
        "HORA_SECRET": secret, "HORA_JOB_ID": job_id,
    })
    if torch_store is not None:
        env.setdefault("MASTER_ADDR", torch_store[0])
        env.setdefault("MASTER_PORT", str(torch_store[1]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def torchrun_env(base_env, rank, size, local_rank, local_size, master_addr, port, hostname,
                 secret):
    """The environment of one rank under torchrun's names, which ``hora.init()`` reads.

    Args:
        base_env: the host's environment; a ``HORA_RANK``/``HORA_SIZE`` placement in it (or
            Horovod's) is dropped, since it would be read before torchrun's.
        master_addr, port: where rank 0 serves the rendezvous (``MASTER_ADDR``,
            ``MASTER_PORT``, ``HORA_RENDEZVOUS_PORT``).
        hostname: this host's name in the job (``HORA_HOSTNAME``).
        secret: the job secret (``HORA_SECRET``).
    """
    env = {k: v for k, v in base_env.items() if not k.startswith(_INHERITED_PLACEMENT)}
    env.update({"RANK": str(rank), "WORLD_SIZE": str(size),
                "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_size),
                "MASTER_ADDR": master_addr, "MASTER_PORT": str(port),
                "HORA_RENDEZVOUS_PORT": str(port), "HORA_HOSTNAME": hostname,
                "HORA_SECRET": secret, "PYTHONUNBUFFERED": "1"})
    return env
