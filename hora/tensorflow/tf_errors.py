"""hora's errors as the ``tf.errors`` types Horovod TensorFlow raises: eagerly, and from
inside a graph (``tf.function``, ``tf.compat.v1`` sessions).

Eagerly a collective's error is made an instance of a class that is both hora's type and
Horovod's ``tf.errors`` type (:func:`tf_error`), so ``except`` clauses written for either
keep working.

Inside a graph, a collective runs in a ``tf.numpy_function`` node, and TensorFlow turns any
Python exception raised there into a status whose code depends on the exception's base
class only (``ValueError``/``TypeError``: ``INVALID_ARGUMENT``, anything else: ``UNKNOWN``);
no op lets Python code choose the code or keep the exception.  So a node that fails
remembers hora's error (:func:`remember`), and the two places where TensorFlow turns a
failed graph's status back into a Python exception (the call of a ``tf.function``, and
``Session.run``) are wrapped once: an ``OpError`` whose message carries a remembered
error's text is replaced by that error, converted as eagerly (``raise ... from`` the
original, whose traceback names the node).  Nothing runs on the success path.  Where a
future TensorFlow moves those places, the hooks are not installed and the errors stay
``UnknownError`` (with hora's message), as before.

Layer: tensorflow (a binding).
"""
from __future__ import annotations

import collections
import functools
import threading
from typing import Any, Callable

import tensorflow as tf

from ..errors import (CollectiveError, CollectiveTimeoutError, DuplicateNameError, HoraError,
                      HoraInternalError, InvalidArgumentError)

__all__ = ["tf_error", "core_call", "remember", "translate",
           "install_hooks"]


_TF_TYPE = [(CollectiveError, tf.errors.FailedPreconditionError),
            (DuplicateNameError, tf.errors.FailedPreconditionError),
            (InvalidArgumentError, tf.errors.InvalidArgumentError),
            (CollectiveTimeoutError, tf.errors.DeadlineExceededError),
            (HoraInternalError, tf.errors.UnknownError)]
_dual_classes: dict[type, type] = {}


def tf_error(e: HoraError) -> Exception:
    """``e`` as an instance of a class that is both ``type(e)`` and the ``tf.errors`` type
    Horovod raises for it (same name, message and attributes)."""
    tf_type = next((t for h, t in _TF_TYPE if isinstance(e, h)), None)
    if tf_type is None or isinstance(e, tf.errors.OpError):
        return e                    # NotInitializedError stays a ValueError, as in Horovod
    cls = _dual_classes.get(type(e))
    if cls is None:
        cls = type(type(e).__name__, (type(e), tf_type),
                   {"__module__": type(e).__module__, "__doc__": type(e).__doc__})
        _dual_classes[type(e)] = cls
    out = cls.__new__(cls)
    tf_type.__init__(out, None, None, str(e))
    out.args = e.args
    out.__dict__.update({k: v for k, v in e.__dict__.items() if not k.startswith("_")})
    return out


def core_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, a hora error raised as :func:`tf_error` makes it."""
    try:
        return fn(*args, **kwargs)
    except HoraError as e:
        converted = tf_error(e)
        if converted is e:
            raise
        raise converted from e


# -- errors raised inside a graph -------------------------------------------------------------
# the errors graph nodes of this process raised lately, as (text TensorFlow quotes, error);
# a few suffice: the status of a failed graph is turned into an exception right away
_recent: collections.deque[tuple[str, HoraError]] = collections.deque(maxlen=32)
_lock = threading.Lock()


def remember(e: HoraError) -> Exception:
    """For a graph node that fails with ``e``: remember it, and return what to raise in the
    node (``tf_error(e)``: TensorFlow quotes its class name and message in the status)."""
    converted = tf_error(e)
    if converted is not e:
        with _lock:
            _recent.append((f"{type(e).__name__}: {e}", e))
    return converted


def translate(error: BaseException) -> Exception | None:
    """The error to raise instead of TensorFlow's ``error`` (an ``OpError`` of a failed
    graph): hora's, if ``error`` quotes one that a node raised lately; else None."""
    if not _recent or not isinstance(error, tf.errors.OpError) or isinstance(error, HoraError):
        return None
    message = str(error.message)
    with _lock:
        found = next((e for text, e in reversed(_recent) if text in message), None)
    return None if found is None else tf_error(found)


def _on_function_error(exit_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap the context manager's ``__exit__`` around every ``tf.function`` call."""
    @functools.wraps(exit_fn)
    def __exit__(self, typ, exc, tb):
        suppressed = exit_fn(self, typ, exc, tb)
        converted = None if suppressed or exc is None else translate(exc)
        if converted is not None:
            raise converted from exc
        return suppressed
    __exit__._hora_hook = True
    return __exit__


def _on_session_error(do_call: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``BaseSession._do_call``, through which every ``Session.run`` goes."""
    @functools.wraps(do_call)
    def _do_call(self, fn, *args):
        try:
            return do_call(self, fn, *args)
        except tf.errors.OpError as e:
            converted = translate(e)
            if converted is None:
                raise
            raise converted from e
    _do_call._hora_hook = True
    return _do_call


def install_hooks() -> bool:
    """Install both wrappers (once); False where this TensorFlow lacks either place."""
    try:
        from tensorflow.python.client.session import BaseSession
        from tensorflow.python.eager.polymorphic_function.atomic_function import \
            InterpolateRuntimeError
    except ImportError:
        return False
    installed = True
    for owner, attr, wrap in ((InterpolateRuntimeError, "__exit__", _on_function_error),
                              (BaseSession, "_do_call", _on_session_error)):
        current = getattr(owner, attr, None)
        if current is None:
            installed = False
        elif not getattr(current, "_hora_hook", False):
            setattr(owner, attr, wrap(current))
    return installed
