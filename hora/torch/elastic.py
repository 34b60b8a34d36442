"""``hvd.elastic``: Horovod's elastic training names for PyTorch.

``TorchState`` (a model, an optimizer, samplers and plain values that can be committed,
restored and synced from rank 0) and ``ElasticSampler`` (a sampler that hands out only the
samples not yet processed this epoch, split over the current ranks) work as Horovod's do.
``run`` is the recovery loop that re-forms the job when workers come and go
(:func:`hora.elastic.run_fn`).

Layer: torch.
"""
from __future__ import annotations

import copy
import math
import random
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.utils.data

from ..core import rank, size
from ..elastic import ObjectState
from ..elastic import run as _elastic_run
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)

__all__ = ["run", "TorchState", "ElasticSampler"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's decorator for an elastic training function ``func(state, ...)``.

    The wrapped function syncs ``state`` from rank 0 and runs ``func``; when a worker fails
    it restores the last commit, re-forms the job with the survivors (in this process: no
    restart) and runs ``func`` again; when workers join or leave it re-forms at the next
    ``state.commit()``.  See :func:`hora.elastic.run_fn`.

    Example::

        @hvd.elastic.run
        def train(state):
            for state.epoch in range(state.epoch, epochs):
                for state.batch, (x, y) in enumerate(loader, start=state.batch):
                    ...
                    if state.batch % 10 == 0:
                        state.commit()
                state.batch = 0

        train(hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0))
    """
    return _elastic_run(func)


class ElasticSampler(torch.utils.data.Sampler):
    """Sampler that splits a dataset over the ranks and re-splits what is left after a reset.

    Like ``DistributedSampler``, but it can record which samples were processed, and
    :meth:`reset` then splits only the samples not yet processed this epoch over the ranks
    there are now.  The order of an epoch is ``range(len(dataset))``, shuffled with
    ``random.Random(seed + epoch)`` when ``shuffle`` (the same on every rank); this rank
    takes every ``size()``-th of the remaining samples starting at ``rank()``, after the
    remaining list is padded with its own first samples to a multiple of ``size()``.

    Record progress one of two ways (not both in one epoch):

    - ``record_batch(batch_idx, batch_size)`` after every batch, on every rank (Horovod's
      current way): the first ``batch_size * size()`` remaining samples count as processed.
    - ``record_indices(indices)`` with the dataset indices this rank processed (for example
      ``get_indices(batch_idx, batch_size)``): on ``TorchState.sync()`` the indices recorded
      by all ranks are combined.

    Put the sampler in a ``TorchState`` and call :meth:`set_epoch` at the *end* of each epoch
    (it clears the record), so that a half-finished epoch is not started over.

    Args:
        dataset: the dataset (its length must not change).
        shuffle: shuffle the samples each epoch.
        seed: the shuffle's seed; the same on every rank.

    Example::

        sampler = hvd.elastic.ElasticSampler(dataset)
        loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
        state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)
        for batch_idx, batch in enumerate(loader):
            ...
            sampler.record_batch(batch_idx, 32)
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed

        self.epoch = 0
        self.processed_num = 0
        self.processed_indices: set[int] = set()

        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0

        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: a new shuffle (when ``shuffle``) and no sample processed.

        Call it at the end of an epoch, not at its start, so that a restored state in the
        middle of an epoch does not process that epoch's samples again.
        """
        self.epoch = epoch
        self.processed_num = 0
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one more batch of ``batch_size`` samples as processed on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: Iterable[int]) -> None:
        """Count the dataset indices ``indices`` as processed."""
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's dataset indices of batch ``batch_idx`` (the last one may be short)."""
        start = batch_idx * batch_size
        return self.indices[start:min(start + batch_size, len(self.indices))]

    def state_dict(self) -> dict[str, Any]:
        """``epoch``, ``processed_num`` and ``processed_indices`` (a copy)."""
        return dict(epoch=self.epoch, processed_num=self.processed_num,
                    processed_indices=set(self.processed_indices))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take over a :meth:`state_dict` (Horovod's, without ``processed_indices``, too)."""
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict.get("processed_num", 0)
        self.processed_indices = set(state_dict.get("processed_indices", ()))
        self.reset()

    def reset(self) -> None:
        """Split the samples not processed this epoch over the current ``size()`` ranks."""
        self.num_replicas = size()
        self.rank = rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = [i for i in order[self.processed_num:]
                                  if i not in self.processed_indices]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas
        self.indices = _shard(self.remaining_indices, self.num_replicas, self.rank)

    def __iter__(self) -> Iterator[int]:
        self.indices = _shard(self.remaining_indices, self.num_replicas, self.rank)
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


def _shard(remaining: list[int], num_replicas: int, rank: int) -> list[int]:
    """``rank``'s share of ``remaining``: pad with its first samples to a multiple of
    ``num_replicas`` (as Horovod does; cyclically when fewer than the padding needs, where
    Horovod's fails), then take every ``num_replicas``-th starting at ``rank``."""
    if not remaining:
        return []
    total = int(math.ceil(len(remaining) / num_replicas)) * num_replicas
    padded = (remaining * int(math.ceil(total / len(remaining))))[:total]
    return padded[rank:total:num_replicas]


class _Handler:
    """Commit, restore and sync of one attribute of a ``TorchState`` that needs more than a
    deep copy and a pickled broadcast."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.save()

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        # a copy, so that training after restore() cannot change the saved tensors
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        raise NotImplementedError


class _ModelHandler(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        # the samples every rank processed, then rank 0's epoch and count
        union = set().union(*allgather_object(self.value.processed_indices))
        state = self.value.state_dict()
        state["processed_indices"] = union
        self.value.load_state_dict(broadcast_object(state))


_HANDLERS: list[tuple[type, type[_Handler]]] = [
    (torch.nn.Module, _ModelHandler),
    (torch.optim.Optimizer, _OptimizerHandler),
    (ElasticSampler, _SamplerHandler),
]


def _handler_for(value: Any) -> _Handler | None:
    for kind, handler in _HANDLERS:
        if isinstance(value, kind):
            return handler(value)
    return None


class TorchState(ObjectState):
    """Elastic state of a PyTorch training process: models, optimizers, samplers, values.

    Every keyword becomes an attribute.  A ``torch.nn.Module`` or ``torch.optim.Optimizer``
    is committed as a deep copy of its ``state_dict()``, restored with
    ``load_state_dict()`` and synced with ``broadcast_parameters`` /
    ``broadcast_optimizer_state`` from rank 0; an :class:`ElasticSampler` is committed and
    restored through its ``state_dict()`` and synced by combining the indices every rank
    processed; anything else is handled as in ``hora.elastic.ObjectState`` (deep copy,
    pickled broadcast).  Assigning a new model, optimizer or sampler to its attribute
    commits it.

    Args:
        model: a model, or None.
        optimizer: an optimizer, or None.
        **kwargs: more attributes: more models, optimizers, samplers, or plain values.

    Example::

        state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
        state.sync()                   # every rank starts from rank 0's weights
        for state.epoch in range(state.epoch, epochs):
            train_one_epoch(state)
            state.commit()
    """

    _handlers: dict[str, _Handler]

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers, plain = {}, {}
        for name, value in kwargs.items():
            handler = _handler_for(value)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        super().__setattr__(name, value)
