"""Stand-ins for refused calls: a call whose own argument checks fail raises on its rank (as
in Horovod) and submits a stand-in under the name the call would have had, so that the ranks
that did submit the collective raise ``CollectiveAbortedError`` naming this rank and its
error rather than wait for it forever.  The stand-in takes the call's place among the
unnamed collectives, so a rank's automatic names stay in step with the other ranks' after a
failed call, as long as every rank makes the same calls.  Layer: core.
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable, Optional, TypeVar, cast

from ..errors import HoraError, NotInitializedError
from . import state
from .messages import KIND_NAMES, Request
from .names import name_of
from .process_sets import member_set_id

F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger(__name__)

__all__ = ["tells_peers", "tell_peers", "abort_call", "count"]


def tells_peers(kind: int, grouped: bool = False) -> Callable[[F], F]:
    """Decorator for a framework binding's collective function: a call that raises before it
    has submitted anything (its own argument checks failed) tells the other ranks, which
    raise ``CollectiveAbortedError`` naming this rank and its error; the error propagates
    here unchanged.

    The stand-in goes under the name the call would have had: its ``name`` argument, or the
    next automatic name of ``kind`` on its process set (drawn now, so that this rank's later
    unnamed collectives stay in step with the other ranks'); when ``grouped``, under
    ``<name>.<i>`` for each tensor of its first argument (one collective each).  An error
    raised once something was submitted (a mismatch found by the coordinator, a dead peer)
    is the collective's own, a :class:`~hora.errors.HoraError`, and nothing more is sent for
    it; wrappers nest: the innermost that sees an error tells the others, once.  hora's own
    collectives do the same around their checks.
    """
    def wrap(fn):
        params = list(inspect.signature(fn).parameters)
        at = {p: params.index(p) for p in ("name", "process_set") if p in params}

        def arg(args, kwargs, p):
            i = at.get(p)
            return args[i] if i is not None and i < len(args) else kwargs.get(p)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                first = args[0] if args else kwargs.get(params[0])
                tell_peers(kind, e, arg(args, kwargs, "name"), arg(args, kwargs, "process_set"),
                           count(first) if grouped else None)
                raise
        return cast(F, call)
    return wrap


def tell_peers(kind: int, error: Exception, name: Optional[str], process_set: Any,
               parts: Optional[int] = None) -> None:
    """What :func:`tells_peers` does when its function raises ``error``, for a binding's
    function that catches its errors itself (its common call then skips the decorator's
    packing of the arguments): tell the other ranks, unless ``error`` is a collective's
    own (a :class:`~hora.errors.HoraError`) or they were told already."""
    if not isinstance(error, HoraError) and not getattr(error, _TOLD, False):
        abort_call(kind, name, process_set, error, parts)


_TOLD = "_hora_told_peers"      # set on an error once the other ranks have been told of it


def abort_call(kind, name, process_set, error, parts=None):
    """Tell the other ranks that this rank's call of a collective failed with ``error``
    before it was submitted: a stand-in request under the name the call would have had."""
    try:
        setattr(error, _TOLD, True)
    except AttributeError:
        pass
    if name is not None and not isinstance(name, str):
        return                              # no name the other ranks could know it by
    try:
        ps = member_set_id(process_set, KIND_NAMES[kind])
        engine = state.engine()
    except (TypeError, ValueError, NotInitializedError):
        return                  # a bad process set, one without this rank, or no job
    except Exception:  # noqa: BLE001 - a bug here must not hide the caller's own error
        log.error("could not tell the other ranks that this rank's %s failed (%s: %s)",
                  KIND_NAMES[kind], type(error).__name__, error, exc_info=True)
        return
    name = name_of(kind, name, ps)
    names = [name] if parts is None else [f"{name}.{i}" for i in range(parts)]
    text = f"{type(error).__name__}: {error}"
    for n in names:
        engine.abort(Request(n, kind, "", ((),), -1, -1, 1.0, 1.0, None, ps, "", text))


def count(items):
    """How many collectives a grouped call of ``items`` submits, if it can be told."""
    try:
        return len(items)
    except TypeError:
        return None
