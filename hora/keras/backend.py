"""What ``hora.keras`` needs from the Keras backend it runs on: which one it is, and how a list
of gradients is reduced over the ranks there.

Keras 3 runs its layers and optimizers on TensorFlow, PyTorch or JAX, and hora serves all
three: with ``KERAS_BACKEND=tensorflow`` gradients are TensorFlow tensors (symbolic inside
``fit``'s compiled train step) and go through :mod:`hora.tensorflow`'s graph-safe
reduction; with ``KERAS_BACKEND=torch`` they are torch tensors and go through
:mod:`hora.torch`'s collectives; with ``KERAS_BACKEND=jax`` they are JAX arrays (tracers
inside the ``jax.jit``-compiled train step) and go through :mod:`hora.jax`'s, which run
inside ``jit`` as ordered host callbacks.  Everything else in ``hora.keras`` is written
once, on ``keras.ops``.

Layer: keras (a binding; imports its sibling bindings and hora.core).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Sequence

from hora.core.gradients import plan_groups, predivide_scales
from hora.core.process_sets import ProcessSet

SERVED = ("tensorflow", "torch", "jax")


def name() -> str:
    """The Keras backend of this process: ``keras.backend.backend()`` once Keras is imported;
    before, what Keras will choose (``KERAS_BACKEND``, else ``~/.keras/keras.json``, else
    tensorflow), so that an unserved backend is named before Keras fails to import it."""
    if "keras" in sys.modules:
        return sys.modules["keras"].backend.backend()
    chosen = os.environ.get("KERAS_BACKEND")
    if chosen:
        return chosen
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json")) as f:
            return str(json.load(f).get("backend", "tensorflow"))
    except (OSError, ValueError):
        return "tensorflow"


def check_served(module: str = "hora.keras") -> str:
    """The backend's name; ImportError naming it when hora does not serve it."""
    backend = name()
    if backend not in SERVED:
        raise ImportError(
            f"{module} runs on Keras' tensorflow, torch and jax backends; this process runs "
            f"Keras on {backend!r} (KERAS_BACKEND).  Set KERAS_BACKEND to tensorflow, torch "
            f"or jax before Keras is imported.")
    return backend


Reducer = Callable[[Sequence[Any], Sequence[Any]], list]


def make_reducer(compression: Any, sparse_as_dense: bool, op: int,
                 gradient_predivide_factor: float, groups: Any, process_set: ProcessSet,
                 prefix: str) -> Reducer:
    """``reduce(grads, variables) -> grads``: the gradients reduced over ``process_set``,
    None staying None, in the groups ``groups`` gives (one collective each, in order)."""
    if name() == "tensorflow":
        from hora.tensorflow.training import _Reducer
        return _Reducer(compression, sparse_as_dense, op, gradient_predivide_factor, groups,
                        process_set)
    return _GroupedReducer(name(), compression, op, gradient_predivide_factor, groups,
                           process_set, prefix)


class _GroupedReducer:
    """Keras-on-torch gradients (dense torch tensors, the train step runs eagerly) or
    Keras-on-JAX ones (arrays, tracers inside ``jit``), reduced by the grouped allreduce of
    hora.torch or hora.jax.  The collectives are named after the optimizer and the group,
    the same names every step, so the engine's response cache serves them."""

    def __init__(self, backend, compression, op, gradient_predivide_factor, groups,
                 process_set, prefix):
        self.backend = backend
        self.compression = compression
        self.op = op
        self.groups = groups
        self.process_set = process_set
        self.prefix = prefix
        self.prescale, self.postscale = predivide_scales(op, gradient_predivide_factor)

    def __call__(self, grads, variables):
        if self.backend == "jax":
            from hora.jax import mpi_ops
        else:
            from hora.torch import mpi_ops  # type: ignore[no-redef]
        out = list(grads)
        if self.process_set.size() == 1:
            return out
        present = [i for i, g in enumerate(out) if g is not None]
        members = [variables[i] for i in present]
        for k, group in enumerate(plan_groups(members, self.groups)):
            chosen = [present[j] for j in group]
            reduced = mpi_ops.grouped_allreduce(
                [out[i] for i in chosen], name=f"{self.prefix}.grads.{k}",
                compression=self.compression, op=self.op, prescale_factor=self.prescale,
                postscale_factor=self.postscale, process_set=self.process_set)
            for i, r in zip(chosen, reduced):
                out[i] = r
        return out
