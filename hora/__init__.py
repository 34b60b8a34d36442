"""hora: distributed data-parallel training with Horovod's API.

    import hora
    hora.init()
    total = hora.allreduce(np.ones(3), op=hora.Sum)

Launch with ``hora run -np 4 python train.py``; the same script also runs under mpirun,
torchrun or Slurm, and alone (a job of size 1).

The core's names (``hora.init``, ``hora.allreduce``, ...) load on first use, so that the
``hora`` command starts without importing NumPy and the engine.
"""
import importlib
import importlib.util
from typing import TYPE_CHECKING

from .errors import (CollectiveAbortedError, CollectiveError,  # noqa: F401
                     CollectiveMismatchError, HoraError, HoraInternalError, HoraRankFailedError,
                     HorovodInternalError, InvalidArgumentError, NotInitializedError,
                     WorkerFailedError)
from .version import __version__  # noqa: F401

if TYPE_CHECKING:       # what editors and type checkers see; at run time it loads on first use
    from .core.handles import Handle  # noqa: F401
    from .core.messages import Adasum, Average, Max, Min, Product, Sum  # noqa: F401
    from .core.objects import allgather_object, broadcast_object  # noqa: F401
    from .core.ops import (allgather, allgather_async,  # noqa: F401
                           allreduce, allreduce_, allreduce_async, allreduce_async_, alltoall,
                           alltoall_async, barrier, barrier_async, broadcast, broadcast_async,
                           grouped_allgather, grouped_allgather_async,
                           grouped_allreduce, grouped_allreduce_async, grouped_allreduce_async_,
                           grouped_reducescatter, grouped_reducescatter_async, join, poll,
                           reducescatter, reducescatter_async, submit_deferred, synchronize)
    from .core.process_sets import (ProcessSet, add_process_set,  # noqa: F401
                                    global_process_set, remove_process_set)
    from .core.lifecycle import init, shutdown  # noqa: F401
    from .core.state import (cross_rank, cross_size, is_homogeneous,  # noqa: F401
                             is_initialized, local_rank, local_size, rank, size)
    from .core.stats import metrics, write_metrics  # noqa: F401

_OWN = ["run", "HoraError", "HoraInternalError", "HorovodInternalError", "HoraRankFailedError",
        "CollectiveError", "CollectiveMismatchError", "CollectiveAbortedError", "InvalidArgumentError",
        "NotInitializedError", "WorkerFailedError", "__version__"]


import typing  # noqa: E402 - run()'s annotations

if typing.TYPE_CHECKING:
    import os
    from collections.abc import Callable, Iterable, Mapping, Sequence
    from typing import Any

    from .runner.remote import SshSettings

_T = typing.TypeVar("_T")


def run(fn: "Callable[..., _T]", args: "Sequence[Any]" = (),
        kwargs: "Mapping[str, Any] | None" = None, np: "int | None" = None, *,
        num_proc: "int | None" = None, hosts: "str | Sequence[Any] | None" = None,
        hostfile: "str | os.PathLike | None" = None, env: "Mapping[str, str] | None" = None,
        timeout_s: "float | None" = None, start_timeout: "float | None" = None,
        prefix_output: bool = True, output_filename: "str | os.PathLike | None" = None,
        grace_s: float = 3.0, executable: "str | None" = None,
        ssh: "SshSettings | None" = None, ssh_port: "int | None" = None,
        ssh_identity_file: "str | os.PathLike | None" = None,
        network_interface: "str | Iterable[str] | None" = None,
        network_interfaces: "str | Iterable[str] | None" = None,
        verbose: "bool | int | None" = None, disable_cache: "bool | None" = None,
        use_gloo: "bool | None" = None, use_mpi: "bool | None" = None,
        mpi_args: "str | None" = None, min_num_proc: "int | None" = None,
        max_num_proc: "int | None" = None, slots: "int | None" = None,
        reset_limit: "int | None" = None,
        cooldown_range: "tuple[int, int] | None" = None,
        host_discovery_script: "str | None" = None,
        elastic_timeout: "float | None" = None) -> "list[_T]":
    """Run ``fn(*args, **kwargs)`` on ``np`` workers (default 2); return their results by rank.

    ``horovod.run``'s keyword names are accepted (``num_proc``, ``hosts``, ``hostfile``,
    ``start_timeout``, ``ssh_port``, ``ssh_identity_file``, ``output_filename``,
    ``verbose``, ``network_interfaces``, ``executable``, ...).  See :func:`hora.runner.run`
    for every argument; the runner is imported only when a job is run.

    Example:
        >>> hora.run(lambda: __import__("os").environ["HORA_RANK"], num_proc=2)  # doctest: +SKIP
        ['0', '1']
    """
    given = dict(locals())          # the arguments, by name: first, before any other name
    from .runner import run as _run
    return _run(**given)


def __getattr__(name):
    if (name.startswith("__") and name != "__all__"
            or importlib.util.find_spec(f"{__name__}.{name}") is not None):
        # dunders, and submodules not imported yet (``from hora import data``)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    core = importlib.import_module(".core", __name__)
    if name == "__all__":
        value = [*core.__all__, *_OWN]
    elif name not in core.__all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    else:
        value = getattr(core, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(importlib.import_module(".core", __name__).__all__))
