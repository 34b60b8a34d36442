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

from .errors import (CollectiveMismatchError, HoraError, HoraInternalError,  # noqa: F401
                     HoraRankFailedError, HorovodInternalError, NotInitializedError,
                     WorkerFailedError)
from .version import __version__  # noqa: F401

_OWN = ["run", "HoraError", "HoraInternalError", "HorovodInternalError", "HoraRankFailedError",
        "CollectiveMismatchError", "NotInitializedError", "WorkerFailedError", "__version__"]


def run(fn, args=(), kwargs=None, np=2, **options):
    """Run ``fn(*args, **kwargs)`` on ``np`` local workers; return their results by rank.

    See :func:`hora.runner.run` for the options.
    """
    from .runner import run as _run
    return _run(fn, args=args, kwargs=kwargs, np=np, **options)


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
