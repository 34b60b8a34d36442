"""``DistributedOptimizer``, ``DistributedTrainer`` and ``broadcast_parameters`` for MXNet.

Both wrappers reduce gradients as ``horovod.mxnet`` does where there is no NCCL (hora has
none): the gradients are *summed* over the ranks (each scaled by
``1 / gradient_predivide_factor`` first), and the division by the number of ranks is the
framework's own gradient rescaling: ``DistributedOptimizer`` multiplies the wrapped
optimizer's ``rescale_grad`` by ``gradient_predivide_factor / size``, ``DistributedTrainer``
its ``_scale`` (``step(batch_size)`` then rescales by ``_scale / batch_size``).  The update
is the one a single process makes on the whole global batch; the gradients left in the
parameters are the sums.

Every gradient's collective is submitted before any is waited for, so the engine fuses
them; their names (``<prefix><i>`` for the trainer's i-th parameter, the optimizer's index
for ``DistributedOptimizer``; ``"<first>:<last>"`` for a group with ``num_groups``) are the
same every step, so the engine's response cache skips negotiation.

Layer: mxnet (a binding).
"""
from __future__ import annotations

import types
import warnings
from collections import OrderedDict
from typing import Any, Optional, Sequence

import mxnet as mx

from .. import core
from ..core.gradients import (broadcast_arrays, check_reduce_options, plan_groups,
                              predivide_scales)
from ..core.messages import Average, Sum
from ..core.process_sets import ProcessSet, global_process_set
from .mpi_ops import Compression, broadcast_, like, to_numpy, write

__all__ = ["DistributedOptimizer", "DistributedTrainer", "broadcast_parameters"]


def _reduce_grads(grads: Sequence[Any], names: Sequence[str], prescale: float,
                  num_groups: int, process_set: ProcessSet,
                  compression: Any = Compression.none) -> None:
    """Sum ``grads`` (NDArrays) over the ranks of ``process_set``, in place, each scaled by
    ``prescale`` first: one allreduce per array, or ``num_groups`` grouped ones."""
    pairs = [compression.compress(g) for g in grads]
    arrays = [to_numpy(sent, "gradient") for sent, _ in pairs]
    plan = plan_groups(arrays, num_groups) if num_groups > 0 else [[i] for i in range(len(grads))]
    handles = []
    for group in plan:
        if len(group) == 1 and num_groups <= 0:
            handles.append(core.allreduce_async(arrays[group[0]], Sum, names[group[0]],
                                                prescale, 1.0, process_set=process_set))
        else:
            handles.append(core.grouped_allreduce_async(
                [arrays[i] for i in group], Sum, f"{names[group[0]]}:{names[group[-1]]}",
                prescale, 1.0, process_set=process_set))
    for group, handle in zip(plan, handles):
        outs = handle.wait()
        for i, out in zip(group, outs if isinstance(outs, list) else [outs]):
            sent, ctx = pairs[i]
            write(grads[i], out if ctx is None else compression.decompress(like(out, sent), ctx))


def _check(gradient_predivide_factor, num_groups):
    check_reduce_options(Average, gradient_predivide_factor)
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be positive, got "
                         f"{gradient_predivide_factor!r}")
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups should be a non-negative integer, got {num_groups!r}")


class DistributedOptimizer(mx.optimizer.Optimizer):
    """An ``mx.optimizer.Optimizer`` whose ``update`` and ``update_multi_precision`` first
    sum the gradients over the ranks (in place), then call the wrapped optimizer's.

    The wrapped optimizer's ``rescale_grad`` is multiplied by
    ``gradient_predivide_factor / process_set.size()`` here, so its update averages.  Every
    other attribute is the wrapped optimizer's, read and written: a ``gluon.Trainer`` that
    sets ``rescale_grad`` (to its scale over ``batch_size``) or ``param_dict`` sets the
    wrapped optimizer's, so ``gluon.Trainer(params, DistributedOptimizer(opt),
    kvstore=None).step(batch_size)`` rescales by ``1 / (size * batch_size)``.  (Horovod's
    wrapper keeps what the trainer sets to itself, and its wrapped optimizer never sees
    ``batch_size``.)

    Args:
        optimizer: the ``mx.optimizer.Optimizer`` to wrap.
        gradient_predivide_factor: scale the gradients by ``1 / f`` before the sum and by
            ``f / size`` after it.
        num_groups: 0: one allreduce per gradient (fused by the engine); n > 0: the
            gradients of each ``update`` call in n grouped allreduces.
        process_set: reduce over these ranks only.

    Example:
        >>> opt = mx.optimizer.create("sgd", learning_rate=0.01 * hvd.size())
        >>> model.fit(train, optimizer=hvd.DistributedOptimizer(opt), kvstore=None)
    """

    def __init__(self, optimizer: Any, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, process_set: ProcessSet = global_process_set):
        _check(gradient_predivide_factor, num_groups)
        own = object.__setattr__
        own(self, "_optimizer", optimizer)
        own(self, "_process_set", process_set)
        own(self, "_num_groups", num_groups)
        own(self, "_gradient_predivide_factor", gradient_predivide_factor)
        own(self, "_prescale", predivide_scales(Average, gradient_predivide_factor)[0])
        optimizer.rescale_grad *= gradient_predivide_factor / process_set.size()

    def __getattr__(self, item: str) -> Any:
        if item == "_optimizer":                 # not set yet (unpickling)
            raise AttributeError(item)
        return getattr(self._optimizer, item)

    def __setattr__(self, item: str, value: Any) -> None:
        if item in self.__dict__:
            object.__setattr__(self, item, value)
        else:
            setattr(self._optimizer, item, value)

    def __getstate__(self) -> dict:
        return dict(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def create_state(self, index, weight):
        """The wrapped optimizer's ``create_state``."""
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index, weight):
        """The wrapped optimizer's ``create_state_multi_precision``."""
        return self._optimizer.create_state_multi_precision(index, weight)

    def _do_allreduce(self, index, grad):
        ps = self._process_set
        if not ps.included() or (ps.size() == 1 and self._prescale == 1.0):
            return
        if isinstance(index, (tuple, list)):
            _reduce_grads(list(grad), [str(i) for i in index], self._prescale,
                          self._num_groups, ps)
        else:
            _reduce_grads([grad], [str(index)], self._prescale, 0, ps)

    def update(self, index, weight, grad, state):
        """Reduce ``grad`` over the ranks, then let the wrapped optimizer update ``weight``."""
        self._do_allreduce(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        """Reduce ``grad`` over the ranks, then let the wrapped optimizer update ``weight``
        (multi-precision)."""
        self._do_allreduce(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    def set_learning_rate(self, lr):
        """Set the wrapped optimizer's learning rate."""
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult):
        """Set the wrapped optimizer's per-parameter learning-rate multipliers."""
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult):
        """Set the wrapped optimizer's per-parameter weight-decay multipliers."""
        self._optimizer.set_wd_mult(args_wd_mult)


class DistributedTrainer(mx.gluon.Trainer):
    """A ``gluon.Trainer`` that sums the gradients over the ranks (no kvstore) and averages
    them through its gradient rescaling, so that ``step(batch_size)`` with the per-rank
    batch size makes the update of one process on the whole global batch.  Parameters on
    several contexts of one process have their gradients summed over those first (as
    ``kvstore="device"`` does), and every context gets the result.

    Args:
        params: the parameters (``Block.collect_params()``, a dict, or a list).
        optimizer: an optimizer name or ``mx.optimizer.Optimizer`` (a
            :class:`DistributedOptimizer` is unwrapped, with a warning).
        optimizer_params: the optimizer's arguments, as for ``gluon.Trainer``.
        compression: ``Compression.none`` or ``Compression.fp16``.
        gradient_predivide_factor: scale the gradients by ``1 / f`` before the sum and by
            ``f / size`` after it.
        prefix: the start of every gradient collective's name; two trainers in one job need
            different prefixes.
        num_groups: 0: one allreduce per parameter (fused by the engine); n > 0: n grouped
            allreduces of contiguous parameters.
        process_set: reduce over these ranks only.

    Example:
        >>> trainer = hvd.DistributedTrainer(net.collect_params(), "sgd",
        ...                                  {"learning_rate": 0.01 * hvd.size()})
        >>> trainer.step(batch_size)                    # the per-rank batch size
    """

    def __init__(self, params: Any, optimizer: Any, optimizer_params: Optional[dict] = None,
                 compression: Any = Compression.none, gradient_predivide_factor: float = 1.0,
                 prefix: Optional[str] = None, num_groups: int = 0,
                 process_set: ProcessSet = global_process_set):
        _check(gradient_predivide_factor, num_groups)
        if prefix is not None and not isinstance(prefix, str):
            raise ValueError(f"prefix must be a str or None, got {prefix!r}")
        if isinstance(optimizer, DistributedOptimizer):
            optimizer = optimizer._optimizer
            warnings.warn("DistributedTrainer does not take a DistributedOptimizer: the "
                          "optimizer it wraps is used", stacklevel=2)
        if isinstance(params, dict):
            params = OrderedDict(params)
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        self._compression = compression
        self._process_set = process_set
        self._prefix = prefix or ""
        self._num_groups = num_groups
        self._prescale = predivide_scales(Average, gradient_predivide_factor)[0]
        self._scale *= gradient_predivide_factor / process_set.size()

    def _allreduce_grads(self):
        ps = self._process_set
        if not ps.included():
            return
        chosen = [(i, p) for i, p in enumerate(self._params) if p.grad_req != "null"]
        several = [p.list_grad() for _, p in chosen if len(p.list_grad()) > 1]
        for first, *others in several:          # several contexts in this process: the sum
            for g in others:
                first += g.as_in_context(first.context)
        if ps.size() > 1 or self._prescale != 1.0:
            _reduce_grads([p.list_grad()[0] for _, p in chosen],
                          [f"{self._prefix}{i}" for i, _ in chosen], self._prescale,
                          self._num_groups, ps, self._compression)
        for first, *others in several:
            for g in others:
                first.copyto(g)


def _broadcast_on_init(param: Any, root_rank: int, name: str) -> None:
    """Make ``param`` (whose initialization is deferred) take ``root_rank``'s values once
    it is initialized: its ``_init_impl`` broadcasts after doing its work."""
    init_impl = param._init_impl

    def init_then_broadcast(self, *args, **kwargs):
        init_impl(*args, **kwargs)
        data = self.list_data()
        broadcast_(data[0], root_rank, name=name)
        for other in data[1:]:
            data[0].copyto(other)
    param._init_impl = types.MethodType(init_then_broadcast, param)


def broadcast_parameters(params: Any, root_rank: int = 0, prefix: Optional[str] = None) -> None:
    """Give every rank ``root_rank``'s values of ``params``, in place.

    ``params`` is a ``Block.collect_params()`` (a ``ParameterDict``) or a dict of
    Parameters or NDArrays (``Module.get_params()``'s dicts).  A Parameter whose
    initialization is deferred is broadcast when it is initialized (in the first forward
    pass, which every rank makes).  The collectives are named ``<prefix><key>``; two calls in
    one job need different prefixes.

    Example:
        >>> net.initialize()
        >>> hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    """
    if core.size() == 1:
        return
    if prefix is not None and not isinstance(prefix, str):
        raise ValueError(f"prefix must be a str or None, got {prefix!r}")
    prefix = prefix or ""
    if not isinstance(params, (dict, mx.gluon.ParameterDict)):
        raise ValueError(f"invalid params of type: {type(params).__name__} (expected a dict or "
                         f"a ParameterDict)")
    tensors, names = [], []
    for key, p in sorted(params.items()):
        if isinstance(p, mx.gluon.Parameter):
            try:
                tensors.append(p.list_data())
            except mx.gluon.parameter.DeferredInitializationError:
                _broadcast_on_init(p, root_rank, prefix + str(key))
                continue
        else:
            tensors.append([p])
        names.append(prefix + str(key))
    values = broadcast_arrays([to_numpy(t[0], "broadcast_parameters") for t in tensors],
                              root_rank, names=names)
    for copies, value in zip(tensors, values):
        for t in copies:
            write(t, value)
