"""``hvd.elastic``: Horovod's elastic training names, which hora does not have yet.

Each name exists with Horovod's signature so that a script fails at the line that uses it,
with a ``NotImplementedError`` that says what to do instead, rather than with an
``AttributeError`` on ``hvd.elastic``.  Layer: torch.
"""
from __future__ import annotations

from typing import Any, Callable, NoReturn

__all__ = ["run", "TorchState", "ElasticSampler"]

_WHAT_INSTEAD = (
    "elastic training (workers joining and leaving a running job) is not available in hora "
    "yet: run a fixed number of workers with `hora run -np N ...`, save a checkpoint on rank "
    "0 every epoch, and restart the job from it after a failure")


def _unavailable(name: str) -> NoReturn:
    raise NotImplementedError(f"hvd.elastic.{name}: {_WHAT_INSTEAD}")


def run(func: Callable[..., Any]) -> NoReturn:
    """Horovod's decorator for an elastic training function.

    Raises:
        NotImplementedError: always (when the function is decorated); see the message.
    """
    _unavailable("run")


class TorchState:
    """Horovod's elastic state of a model and an optimizer.

    Raises:
        NotImplementedError: always (when constructed); see the message.
    """

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        _unavailable("TorchState")


class ElasticSampler:
    """Horovod's sampler that reshards the remaining samples when workers change.

    Raises:
        NotImplementedError: always (when constructed).  For a fixed number of workers use
            ``torch.utils.data.distributed.DistributedSampler(dataset,
            num_replicas=hvd.size(), rank=hvd.rank(), shuffle=shuffle, seed=seed)``.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        raise NotImplementedError(
            "hvd.elastic.ElasticSampler: elastic training is not available in hora yet; for "
            "a fixed number of workers use torch.utils.data.distributed.DistributedSampler("
            "dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=shuffle, seed=seed)")
