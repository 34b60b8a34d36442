"""``DistributedOptimizer``: wrap a torch optimizer so that ``step()`` applies gradients
averaged over every rank.

Each parameter gets a hook that fires as soon as autograd has accumulated its gradient;
gradients are reduced in buckets (one flat buffer each, which the gradients become views of),
each starting as soon as its last gradient is ready, so communication overlaps the rest of
``backward()`` where a CPU or an accelerator is free for it.  ``step()`` (or an explicit
``synchronize()``) waits for those allreduces, leaves the results in ``p.grad`` and then
runs the wrapped optimizer.

The wrapper is a ``torch.optim.Optimizer`` that delegates to the optimizer it wraps and shares
its ``param_groups``, ``state`` and ``defaults``, so LR schedulers, ``state_dict()`` and
checkpoints see one optimizer.  Horovod instead builds a subclass of the wrapped class at run
time; see STYLE.md for why hora does not.

Which gradients travel together and their flat buffers are :mod:`hora.torch.buckets`; the
hooks, :mod:`hora.torch.grad_hooks`; the parameters' names, :mod:`hora.torch.param_names`.
Layer: torch.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .. import core
from ..core import membership, stats
from ..core.gradients import (check_passes, check_reduce_options, noname, predivide_scales,
                              resolve_groups)
from ..core.process_sets import ProcessSet, global_process_set
from .buckets import Group, copy_all, flattenable, group_chunks, unflatten
from .compression import Compression, Compressor
from .grad_hooks import grad_accumulator, hook_grad_ready, remove_hooks
from .mpi_ops import (Adasum, Average, Sum, allreduce_async_, grouped_allreduce_async_,
                      sparse_allreduce_async, synchronize)
from .param_names import parameter_names

__all__ = ["DistributedOptimizer"]

_TOO_MANY_PASSES = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally.")
_ZERO_GRAD_RACE = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
_STEP_AFTER_SYNC = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")


WRAPPED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()   # what wrappers hold


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so that its gradients are reduced over the ranks before each step.

    Args:
        optimizer: any ``torch.optim.Optimizer``.  Keep using the wrapper, not the original.
        named_parameters: ``model.named_parameters()`` (or ``(name, tensor)`` pairs covering
            every parameter of ``optimizer``).  The names key the allreduces, so they must be
            the same on every rank; without them parameters are named by their position.
        compression: ``Compression.none`` or ``Compression.fp16`` (send float gradients as
            float16).
        backward_passes_per_step: ``backward()`` calls to accumulate locally before the
            gradients are reduced.  Scale the loss by ``1 / backward_passes_per_step`` to
            average the micro-batches.
        op: ``Average`` (default) or ``Sum``.
        gradient_predivide_factor: with ``Average``, multiply gradients by ``1 / f`` before
            the sum and by ``f / size`` after it (guards low-precision sums from overflow).
        num_groups: deprecated; use ``groups``.
        groups: an int (split the parameters into that many groups) or a list of lists of
            parameters.  A group is reduced as one collective once all its gradients are
            ready; parameters in no list form groups of their own.  Without ``groups``,
            parameters are packed in reverse order into buckets of ``HORA_BUCKET_CAP_MB``
            (25) MB, as DDP does: the same averages as one allreduce per tensor, in far
            fewer collectives (``HORA_BUCKET_CAP_MB=0`` gives Horovod's one per tensor).
            The first bucket, which backward fills first, holds
            ``HORA_FIRST_BUCKET_CAP_MB``; by default 1 MB (DDP's) when a CPU is free for
            the communication (a GPU model, or fewer ranks x torch threads than CPUs on
            this host), else a whole bucket: where backward uses every CPU, reducing
            early only slows it down.
        sparse_as_dense: reduce sparse gradients (``nn.Embedding(..., sparse=True)``) as
            dense tensors, one allreduce each, and make them sparse again before the step.
            By default they are reduced as Horovod does, by gathering every rank's indices
            and values (:func:`sparse_allreduce_async`), which sends only the rows touched;
            such a parameter leaves its bucket at its first sparse gradient.  Every rank
            must then produce a sparse gradient for it in that first step.
        process_set: reduce over the ranks of this process set only.

    Attributes that Horovod's optimizer has, with its meaning, for code that reads them:
    ``backward_passes_per_step``, ``op``, ``gradient_predivide_factor``,
    ``sparse_as_dense``, ``process_set``, ``_parameter_names`` (parameter -> name: the
    name from ``named_parameters``, else ``allreduce.noname.<group>.<index>``; the same on
    every rank), ``_allreduce_delay`` (parameter -> backward passes left before its
    gradient is reduced), ``_requires_update`` (the parameters that ``synchronize()``
    reduces even when this rank computed no gradient for them; assign ``set()`` to reduce
    only gradients computed), ``_handles`` (reductions in flight, keyed by parameter or by
    a tuple of grouped parameters), ``_grad_accs``, ``_groups`` (the ``groups``
    argument), ``_synchronized`` and ``_should_synchronize``.

    Example (gradient clipping on the reduced gradients)::

        optimizer = hvd.DistributedOptimizer(optimizer,
                                             named_parameters=model.named_parameters())
        loss.backward()
        optimizer.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        with optimizer.skip_synchronize():
            optimizer.step()
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.Tensor]]
                 | Mapping[str, torch.Tensor] | None = None,
                 compression: type[Compressor] = Compression.none,
                 backward_passes_per_step: int = 1, op: int = Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups: int | Sequence[Sequence[torch.Tensor]] | None = None,
                 sparse_as_dense: bool = False,
                 process_set: ProcessSet = global_process_set) -> None:
        op = _check_options(optimizer, backward_passes_per_step, op,
                            gradient_predivide_factor, process_set)
        groups = resolve_groups(num_groups, groups, _is_tensor, "torch.Tensor")

        self._opt = optimizer
        WRAPPED.add(optimizer)      # (its steps are this wrapper's: counted once, here)
        # Optimizer.__init__ would rebuild param_groups and state; the wrapper shares the
        # wrapped optimizer's.  __setstate__ is how torch restores an optimizer without
        # __init__: it creates the hook tables and wraps step() with hook support.
        torch.optim.Optimizer.__setstate__(self, {})

        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set

        # Horovod's names (user code reads them); the allreduces go by self._names
        self._parameter_names = parameter_names(self.param_groups, named_parameters)
        prefix = "" if named_parameters is None else "allreduce."
        self._names = {p: f"{prefix}{n}" for p, n in self._parameter_names.items()}
        self._groups = groups    # the groups argument, as Horovod keeps it
        # param -> backward passes left before its allreduce starts
        self._allreduce_delay: dict[torch.Tensor, int] = {}
        # params that synchronize() reduces even when this rank computed no gradient
        self._requires_update: set[torch.Tensor] = set()
        self._group_of: dict[torch.Tensor, Group] = {}      # param -> its Group
        self._buckets: list[Group] = []
        # in flight: param, or a group's tuple of params -> (callable that waits and writes
        # p.grad, None); Horovod's keys, and its (handle, ctx) pairs with a callable handle
        self._handles: dict[Any, tuple[Callable[[], None], None]] = {}
        # params whose gradient arrived since the last synchronize
        self._touched: set[torch.Tensor] = set()
        # param -> sparse_dim of its sparse gradients, once seen
        self._sparse_dims: dict[torch.Tensor, int] = {}
        self._hooks: list[Any] = []
        self._synchronized = False
        self._should_synchronize = True
        self._defer = False      # submit without waking the engine thread (see _start)

        # a job (or process set) of one has nothing to average: no hooks, no collectives,
        # the wrapped optimizer at full speed (as Horovod does)
        # alone: nothing to reduce, no hooks; never in an elastic job, which may grow
        self._alone = (process_set.included() and process_set.size() == 1
                       and not membership.is_elastic())
        if process_set.included() and not self._alone:
            params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
            self._form_groups(groups, params)
            self._add_hooks(params)
        # the hooks reach us through a weak reference; they go when we are collected
        weakref.finalize(self, remove_hooks, self._hooks)

    # -- the wrapped optimizer's tables, shared ---------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._opt

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._opt.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._opt.param_groups = value

    @property
    def state(self) -> defaultdict[torch.Tensor, Any]:
        return self._opt.state

    @state.setter
    def state(self, value: defaultdict[torch.Tensor, Any]) -> None:
        self._opt.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self._opt.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._opt.defaults = value

    @property
    def _grad_accs(self) -> list[Any]:
        """Horovod's list of the gradient accumulators (autograd nodes) of the parameters
        whose gradients are reduced; hora hooks the parameters themselves."""
        with torch.enable_grad():
            # every parameter here requires a gradient: its view has a grad_fn
            return [grad_accumulator(p) for p in self._allreduce_delay]

    def __getattr__(self, name):
        # only reached for names the wrapper lacks: a custom optimizer's own attributes
        opt = self.__dict__.get("_opt")
        if opt is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(opt, name)

    def __getstate__(self):
        raise TypeError("a DistributedOptimizer cannot be pickled (its hooks belong to this "
                        "process); save optimizer.state_dict() instead")

    def __repr__(self):
        return f"DistributedOptimizer({self._opt!r})"

    # -- hooks ------------------------------------------------------------------------------
    def _form_groups(self, spec, params):
        chunks, self._defer = group_chunks(spec, params)
        for chunk in chunks:
            if len(chunk) > 1:
                group = Group(chunk)
                self._buckets.append(group)
                for p in group.params:
                    self._group_of[p] = group

    def _add_hooks(self, params):
        me = weakref.ref(self)
        for p in params:
            if not p.requires_grad or p in self._allreduce_delay:
                continue
            self._allreduce_delay[p] = self.backward_passes_per_step
            self._requires_update.add(p)
            self._hooks.append(hook_grad_ready(p, me))

    def _grad_ready(self, p):
        """Autograd has accumulated ``p.grad`` for one backward pass."""
        delay = self._allreduce_delay
        if delay[p] <= 0:
            raise AssertionError(_TOO_MANY_PASSES)
        delay[p] -= 1
        self._touched.add(p)
        self._synchronized = False
        if delay[p] > 0:
            return
        group = self._group_of.get(p)
        if group is None:
            self._start(p)
            return
        group.ready += 1
        if group.ready == len(group.params):
            self._start(group)

    def _start(self, unit):
        """Start reducing a parameter's or a group's gradients.

        Without a CPU to spare (see :func:`~hora.torch.buckets.spare_cpu`) the engine
        thread is not woken: it would take the CPU from the rest of backward, or this thread
        would wait for it to give the CPU back.  ``step()`` sends and runs the collectives
        itself while it waits for them (the engine thread's periodic look sends them, were it
        not to)."""
        units = [unit]
        if isinstance(unit, Group) and not self.sparse_as_dense and any(
                p.grad is not None and p.grad.is_sparse for p in unit.params):
            units = self._split_off_sparse(unit)
        for u in units:
            launch = self._launch_group if isinstance(u, Group) else self._launch
            if self._defer:
                finish = core.submit_deferred(lambda: launch(u))  # noqa: B023 - runs now
            else:
                finish = launch(u)
            self._handles[_key(u)] = (finish, None)

    def _split_off_sparse(self, group):
        """Take the parameters with sparse gradients out of ``group`` for good: each is
        reduced by gathering its indices and values from now on, the rest stay together.
        Every rank makes the same split at the same step, since the same layers produce
        sparse gradients everywhere.  Returns the units to launch now."""
        sparse = [p for p in group.params if p.grad is not None and p.grad.is_sparse]
        rest = [p for p in group.params if not (p.grad is not None and p.grad.is_sparse)]
        for p in sparse:
            del self._group_of[p]
        if len(rest) > 1:
            group.params = tuple(rest)
            group.forget_buffer()
            return [*sparse, group]
        self._buckets.remove(group)
        for p in rest:
            del self._group_of[p]
        return [*sparse, *rest]

    # -- allreduce --------------------------------------------------------------------------
    def _scales(self):
        return predivide_scales(self.op, self.gradient_predivide_factor)

    def _launch(self, p):
        """Start reducing ``p.grad``; returns a callable that waits and writes the result."""
        if p.grad is None:
            p.grad = self._missing_grad(p)
        grad = p.grad
        if grad.is_sparse:
            self._sparse_dims[p] = grad.sparse_dim()
            if not self.sparse_as_dense:
                return self._launch_sparse(p)
            grad = grad.to_dense()
        sent, ctx = self._compression.compress(grad)
        pre, post = self._scales()
        handle = allreduce_async_(sent, name=self._names[p], op=self.op, prescale_factor=pre,
                                  postscale_factor=post, process_set=self.process_set)

        def finish():
            _store(p, self._compression.decompress(synchronize(handle), ctx))
        return finish

    def _missing_grad(self, p):
        """The gradient to contribute for ``p`` when this rank computed none (another rank
        may have): zeros, in the layout the others send (the same collectives everywhere)."""
        dims = self._sparse_dims.get(p)
        return torch.zeros_like(p) if dims is None else _empty_sparse(p, dims)

    def _launch_group(self, group):
        grads = []
        for p in group.params:
            if p.grad is None:
                p.grad = self._missing_grad(p)
            elif p.grad.is_sparse:
                self._sparse_dims[p] = p.grad.sparse_dim()
            grads.append(p.grad)
        name = f"{self._names[group.params[0]]}.group"
        if self._compression in _ELEMENTWISE and flattenable(grads):
            return self._launch_flat(group, name, grads)
        sent, ctxs = [], []
        for grad in grads:
            t, ctx = self._compression.compress(grad.to_dense() if grad.is_sparse else grad)
            sent.append(t)
            ctxs.append(ctx)
        pre, post = self._scales()
        handle = grouped_allreduce_async_(sent, name=name, op=self.op, prescale_factor=pre,
                                          postscale_factor=post, process_set=self.process_set)

        def finish():
            for p, out, ctx in zip(group.params, synchronize(handle), ctxs):
                _store(p, self._compression.decompress(out, ctx))
        return finish

    def _launch_flat(self, group, name, grads):
        """A bucket of dense gradients of one dtype and device, reduced as one flat buffer
        (the group's, kept from step to step).  Once reduced, the gradients are views of
        that buffer, as with DDP's ``gradient_as_bucket_view``: while they stay so
        (``zero_grad()`` keeps them), autograd accumulates straight into the buffer and a
        step copies nothing in or out.  The compressors applied here work element by
        element, so compressing the buffer gives the bits that compressing each gradient
        would."""
        flat, views = group.flat_buffer(grads)
        viewed = all(g is v for g, v in zip(grads, views))
        if not viewed:
            copy_all(views, grads)          # one torch call for the whole bucket
        sent, ctx = self._compression.compress(flat)
        pre, post = self._scales()
        handle = allreduce_async_(sent, name=name, op=self.op, prescale_factor=pre,
                                  postscale_factor=post, process_set=self.process_set)

        def finish():
            out = self._compression.decompress(synchronize(handle), ctx)
            if out is not flat:
                copy_all(views, unflatten(out, grads))
            if not viewed:
                for p, v in zip(group.params, views):
                    p.grad = v
        return finish

    def _launch_sparse(self, p):
        # sparse gradients of different ranks touch different rows: gather everyone's
        # (index, value) pairs, as Horovod does
        handle = sparse_allreduce_async(p.grad, self._names[p], self.op, self.process_set)

        def finish():
            p.grad = handle()
        return finish

    def _units(self):
        """Every parameter or group this rank reduces, in parameter order."""
        seen = set()
        for g in self.param_groups:
            for p in g["params"]:
                unit = self._group_of.get(p, p)
                if p in self._allreduce_delay and unit not in seen:
                    seen.add(unit)
                    yield unit

    # -- the optimizer API ------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every gradient's allreduce and write the results into ``p.grad``.

        Gradients that did not (yet) start their allreduce (parameters unused in this step,
        or fewer backward passes than ``backward_passes_per_step``) are reduced now, so every
        rank submits the same collectives.  A second call with no backward pass in between
        does nothing.
        """
        if self._synchronized or self._alone or not self.process_set.included():
            self._synchronized = True
            return
        try:
            wanted = self._requires_update
            for unit in self._units():
                if _key(unit) in self._handles:
                    continue
                params = unit.params if isinstance(unit, Group) else (unit,)
                if any(p in self._touched or p in wanted for p in params):
                    self._start(unit)
            for finish, _ in list(self._handles.values()):
                finish()
        finally:
            self._reset()
        self._synchronized = True

    def _reset(self):
        self._handles.clear()
        self._touched.clear()
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        for group in self._buckets:
            group.ready = 0

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this context ``step()`` does not synchronize: use it after calling
        ``synchronize()`` yourself (see the class example)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Synchronize (unless inside ``skip_synchronize()``), then step the wrapped
        optimizer.

        A ``closure`` computes fresh gradients inside the wrapped ``step()``; they are
        reduced before the wrapped optimizer uses them.  Every rank must evaluate the
        closure equally often, so an optimizer that decides on the loss (L-BFGS) needs a
        closure that returns the loss averaged over the ranks.
        """
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(_STEP_AFTER_SYNC, stacklevel=2)
            self.synchronize()
        self._synchronized = False
        stats.step()
        if closure is None:
            return self._opt.step()

        def closure_then_reduce():
            loss = closure()
            self.synchronize()
            return loss
        try:
            return self._opt.step(closure_then_reduce)
        finally:
            # the closure's synchronize() is part of this step, not one the next step
            # should warn about
            self._synchronized = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``; refused while gradients are in flight.

        The gradients of a bucket, views of its flat buffer (see ``_launch_flat``), are
        zeroed in place whatever ``set_to_none`` says, so that the next backward pass
        accumulates into the buffer again.  (Parameters whose gradient is missing after
        ``backward()`` are reduced as zeros either way, as in Horovod.)  The others are
        zeroed or set to None as torch does.
        """
        if self._handles or self._touched:
            raise AssertionError(_ZERO_GRAD_RACE)
        kept = set()
        for group in self._buckets:
            if group.holds_grads():
                group.zero()
                kept.update(group.params)
        if not kept:
            return self._opt.zero_grad(set_to_none=set_to_none)
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None or p in kept:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()``."""
        return self._opt.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped optimizer's state; forgets gradients not yet synchronized."""
        self._reset()
        self._synchronized = False
        self._should_synchronize = True
        self._opt.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the wrapped optimizer; its parameters are reduced too
        (named from ``named_parameters`` when given there, else by position)."""
        self._opt.add_param_group(param_group)
        index = len(self.param_groups) - 1
        for j, p in enumerate(self.param_groups[index]["params"]):
            if p not in self._parameter_names:
                self._parameter_names[p] = self._names[p] = noname(index, j)
        if self.process_set.included() and not self._alone:
            self._add_hooks(self.param_groups[index]["params"])

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change ``backward_passes_per_step``; restarts the count of the current step."""
        check_passes(passes)
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes


# -- helpers -------------------------------------------------------------------------------
_ELEMENTWISE = (Compression.none, Compression.fp16)


def _key(unit):
    """A unit's key in ``_handles``: the parameter, or the tuple of a group's (Horovod's)."""
    return unit.params if isinstance(unit, Group) else unit


def _empty_sparse(p, sparse_dims):
    """A sparse gradient of ``p`` with no entries."""
    return torch.sparse_coo_tensor(
        torch.empty((sparse_dims, 0), dtype=torch.long, device=p.device),
        torch.empty((0, *p.shape[sparse_dims:]), dtype=p.dtype, device=p.device), p.shape,
        check_invariants=False)


def _store(p, result):
    """Put a reduced gradient into ``p.grad`` (in place when it is not already there); a
    sparse gradient reduced densely becomes sparse again, in its own layout."""
    grad = p.grad
    if grad.is_sparse:
        p.grad = result if result.is_sparse else result.to_sparse(grad.sparse_dim())
    elif result is not grad:
        grad.copy_(result)


def _check_options(optimizer, passes, op, predivide, process_set):
    """Validate the constructor's arguments; returns the op to use."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, DistributedOptimizer):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    check_passes(passes)
    check_reduce_options(op, predivide)
    if op == Adasum:
        if process_set.size() > 1:
            raise NotImplementedError("DistributedOptimizer: the Adasum op is not implemented "
                                      "yet; use op=hvd.Average")
        return Sum                               # one rank: Adasum leaves the gradient as is
    return op


def _is_tensor(x):
    return isinstance(x, torch.Tensor)
