"""What a SageMaker training container tells a job about itself, read from its files.

SageMaker writes ``<root>/input/config/resourceconfig.json`` (the job's hosts and which one
this is), ``hyperparameters.json`` (string values; the MPI distribution option arrives as
``sagemaker_mpi_*`` keys) and ``inputdataconfig.json`` (each channel's input mode), and its
training toolkit exports ``SM_*`` variables.  ``<root>`` is ``/opt/ml``, or
``HORA_SAGEMAKER_ROOT`` (``SAGEMAKER_BASE_DIR``, the toolkit's own override, is honoured
too), so that tests and local runs can use a tree of their own.

This module only reads; ``hora.init()`` uses it to place a process when SageMaker started one
per host, ``hora.data`` to find channels, the integration to launch processes per host.

Layer: core.  Imports hora.config and hora.errors only.
"""
import dataclasses
import json
import os
from pathlib import Path

from .. import config
from ..errors import SageMakerConfigError

__all__ = ["SageMakerEnv", "sagemaker_root", "read_sagemaker_env", "DEFAULT_ROOT",
           "DEFAULT_RENDEZVOUS_PORT"]

DEFAULT_ROOT = "/opt/ml"
# Port of the rendezvous rank 0 serves on the first host when SageMaker, not a hora launcher,
# started the processes (HORA_RENDEZVOUS_PORT overrides it); every host must agree on it
# without talking first, so it is fixed.
DEFAULT_RENDEZVOUS_PORT = 29501


def sagemaker_root(root=None, env=None):
    """The SageMaker base directory: ``root``, HORA_SAGEMAKER_ROOT, SAGEMAKER_BASE_DIR or
    ``/opt/ml``."""
    env = os.environ if env is None else env
    return Path(root or config.env_value("SAGEMAKER_ROOT", env)
                or env.get("SAGEMAKER_BASE_DIR") or DEFAULT_ROOT)


def _read_json(path, default):
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return default
    except OSError as e:
        raise SageMakerConfigError(f"cannot read {path}: {e}") from e
    try:
        return json.loads(text)
    except ValueError as e:
        raise SageMakerConfigError(f"{path} is not valid JSON: {e}") from e


def _decode(value):
    # SageMaker passes every hyperparameter as a string; the SDK JSON-encodes the values
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


@dataclasses.dataclass(frozen=True)
class SageMakerEnv:
    """One container's view of its SageMaker training job.

    Attributes:
        root: the base directory (``/opt/ml``).
        hosts: the job's hosts, sorted as SageMaker lists them (``algo-1``, ``algo-2``...).
        current_host: this container's host.
        network_interface: the interface SageMaker names for traffic between hosts.
        hyperparameters: decoded ``hyperparameters.json`` (the ``sagemaker_*`` keys included).
        channels: ``inputdataconfig.json``: channel name -> its settings.
        num_gpus: GPUs on this host (``SM_NUM_GPUS``; 0 when unknown).
        env: the environment it was read from (for the ``SM_*`` paths).
    """
    root: Path
    hosts: tuple
    current_host: str
    network_interface: str = "eth0"
    hyperparameters: dict = dataclasses.field(default_factory=dict)
    channels: dict = dataclasses.field(default_factory=dict)
    num_gpus: int = 0
    env: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def host_index(self):
        """This host's position in :attr:`hosts` (host 0 is the master)."""
        return self.hosts.index(self.current_host)

    @property
    def mpi_enabled(self):
        """Whether the job asked for SageMaker's MPI distribution (``sagemaker_mpi_enabled``)."""
        return self.hyperparameters.get("sagemaker_mpi_enabled") in (True, "true", "True")

    @property
    def processes_per_host(self):
        """``sagemaker_mpi_num_of_processes_per_host``, else one per GPU, else 1 (the
        toolkit's rule)."""
        value = self.hyperparameters.get("sagemaker_mpi_num_of_processes_per_host")
        if value is None:
            return self.num_gpus or 1
        try:
            count = int(value)
        except (TypeError, ValueError):
            count = 0
        if count < 1:
            raise SageMakerConfigError(
                f"hyperparameter sagemaker_mpi_num_of_processes_per_host={value!r}: expected "
                f"a positive integer")
        return count

    @property
    def num_processes(self):
        """``sagemaker_mpi_num_processes``, else hosts times processes per host."""
        value = self.hyperparameters.get("sagemaker_mpi_num_processes")
        total = len(self.hosts) * self.processes_per_host
        if value is None:
            return total
        try:
            count = int(value)
        except (TypeError, ValueError):
            count = 0
        if not 1 <= count <= total:
            raise SageMakerConfigError(
                f"hyperparameter sagemaker_mpi_num_processes={value!r}: expected 1..{total} "
                f"({len(self.hosts)} hosts x {self.processes_per_host} processes)")
        return count

    @property
    def custom_mpi_options(self):
        """``sagemaker_mpi_custom_mpi_options`` (a string of extra mpirun arguments)."""
        return str(self.hyperparameters.get("sagemaker_mpi_custom_mpi_options") or "")

    @property
    def model_dir(self):
        """Where the model goes to be uploaded: ``SM_MODEL_DIR`` or ``<root>/model``."""
        return Path(self.env.get("SM_MODEL_DIR") or self.root / "model")

    @property
    def data_dir(self):
        """``<root>/input/data``: File-mode channel directories and Pipe-mode FIFOs."""
        return self.root / "input" / "data"

    def channel_dir(self, name):
        """A File-mode channel's directory: ``SM_CHANNEL_<NAME>`` or ``<root>/input/data/name``."""
        return Path(self.env.get(f"SM_CHANNEL_{name.upper()}") or self.data_dir / name)

    def input_mode(self, name):
        """``"File"``, ``"FastFile"`` or ``"Pipe"`` for a channel (``"File"`` if unlisted)."""
        return (self.channels.get(name) or {}).get("TrainingInputMode", "File")


def read_sagemaker_env(root=None, env=None):
    """This container's :class:`SageMakerEnv`, or None outside SageMaker.

    A container is in SageMaker when ``<root>/input/config/resourceconfig.json`` exists (or,
    without it, when ``SM_HOSTS`` and ``SM_CURRENT_HOST`` are set).

    Raises:
        SageMakerConfigError: a file is unreadable, or the current host is not among the hosts.
    """
    env = os.environ if env is None else env
    base = sagemaker_root(root, env)
    conf = base / "input" / "config"
    resources = _read_json(conf / "resourceconfig.json", None)
    if resources is None:
        if not (env.get("SM_HOSTS") and env.get("SM_CURRENT_HOST")):
            return None
        try:
            resources = {"hosts": json.loads(env["SM_HOSTS"]),
                         "current_host": env["SM_CURRENT_HOST"]}
        except ValueError as e:
            raise SageMakerConfigError(f"SM_HOSTS={env['SM_HOSTS']!r} is not a JSON list") from e
        resources["network_interface_name"] = env.get("SM_NETWORK_INTERFACE_NAME")
    where = conf / "resourceconfig.json"
    hosts = resources.get("hosts")
    current = resources.get("current_host")
    if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) for h in hosts):
        raise SageMakerConfigError(f"{where}: 'hosts' must be a non-empty list of names, "
                                   f"got {hosts!r}")
    if current not in hosts:
        raise SageMakerConfigError(f"{where}: current_host {current!r} is not one of the hosts "
                                   f"{hosts}")
    hyper = _read_json(conf / "hyperparameters.json", {})
    channels = _read_json(conf / "inputdataconfig.json", {})
    if not isinstance(hyper, dict) or not isinstance(channels, dict):
        raise SageMakerConfigError(f"{conf}: hyperparameters.json and inputdataconfig.json "
                                   f"must hold JSON objects")
    try:
        gpus = int(env.get("SM_NUM_GPUS") or 0)
    except ValueError:
        gpus = 0
    return SageMakerEnv(root=base, hosts=tuple(hosts), current_host=current,
                        network_interface=resources.get("network_interface_name") or "eth0",
                        hyperparameters={k: _decode(v) for k, v in hyper.items()},
                        channels=channels, num_gpus=gpus, env=dict(env))
