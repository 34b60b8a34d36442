"""``hora.tensorflow.util``: the small helpers Horovod's ``horovod.tensorflow.util`` offers and
users' test helpers import (``_executing_eagerly`` above all).

Layer: tensorflow (a binding).
"""
from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

__all__ = ["_executing_eagerly", "_make_subgraph", "_cache", "vars_to_refs", "refs_to_vars"]


def _executing_eagerly() -> bool:
    """True where TensorFlow runs ops at once (not while a graph is built)."""
    return tf.executing_eagerly()


def _make_subgraph(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` as a ``tf.function``."""
    return tf.function(f)


def _cache(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` memoised on its (hashable) arguments and on whether TensorFlow runs eagerly."""
    results: dict[Any, Any] = {}

    def cached(*args: Any) -> Any:
        key = (args, tf.executing_eagerly())
        if key not in results:
            results[key] = f(*args)
        return results[key]
    return cached


def vars_to_refs(variables: Any) -> Any:
    """Variables (nested lists) as hashable references (nested tuples)."""
    if isinstance(variables, list):
        return tuple(vars_to_refs(v) for v in variables)
    return variables.ref()


def refs_to_vars(refs: Any) -> Any:
    """The inverse of :func:`vars_to_refs`."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()
