"""hora: distributed data-parallel training with Horovod's API.

    import hora
    hora.init()
    total = hora.allreduce(np.ones(3), op=hora.Sum)

Launch with ``hora run -np 4 python train.py``; the same script also runs under mpirun,
torchrun or Slurm, and alone (a job of size 1).
"""
from .core import *  # noqa: F401,F403
from .core import __all__ as _core_all
from .errors import (CollectiveMismatchError, HoraError, HoraInternalError,  # noqa: F401
                     HoraRankFailedError, HorovodInternalError, NotInitializedError,
                     WorkerFailedError)
from .version import __version__


def run(fn, args=(), kwargs=None, np=2, **options):
    """Run ``fn(*args, **kwargs)`` on ``np`` local workers; return their results by rank.

    See :func:`hora.runner.run` for the options.
    """
    from .runner import run as _run
    return _run(fn, args=args, kwargs=kwargs, np=np, **options)


__all__ = [*_core_all, "run", "HoraError", "HoraInternalError", "HorovodInternalError",
           "HoraRankFailedError", "CollectiveMismatchError", "NotInitializedError",
           "WorkerFailedError", "__version__"]
