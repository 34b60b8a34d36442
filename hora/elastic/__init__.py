"""Elastic training state, framework-neutral: ``State`` and ``ObjectState`` (Horovod's names).

A state is what a training function must get back after a failure: ``commit()`` keeps a
copy in host memory, ``restore()`` puts the last commit back, ``sync()`` makes every rank
hold rank 0's copy.  The framework bindings subclass ``ObjectState`` (``hora.torch.elastic``'s
``TorchState`` adds models, optimizers and samplers).

:func:`run_fn` is the recovery loop that drives them (``hvd.elastic.run`` in every binding):
call the training function; when a rank fails (``HorovodInternalError``) restore the last
commit, leave the broken job and join the next one the launcher forms with the survivors,
sync from the new rank 0 and call the function again; when hosts were added or removed
(``HostsUpdatedInterrupt``, raised on every rank at the same ``commit()``) do the same
without the restore.

Layer: elastic.  Imports ``errors`` and ``core``'s membership questions; collectives come in
as functions (``bcast_object``, ``get_rank``) so that this module knows no framework.
"""
from __future__ import annotations

import copy
import functools
import logging
from typing import Any, Callable, Iterable

from ..core import membership
from ..core.lifecycle import elastic_news
from ..errors import HoraError, HoraInternalError, HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["State", "ObjectState", "run", "run_fn", "unwrap_internal_errors",
           "HorovodInternalError", "HostsUpdatedInterrupt"]

log = logging.getLogger(__name__)


class State:
    """Training state that every worker keeps in memory and can commit, restore and sync.

    Subclasses implement :meth:`save`, :meth:`restore` and :meth:`sync`.

    Args:
        bcast_object: ``bcast_object(obj)`` returns rank 0's ``obj`` on every rank.
        get_rank: returns this worker's rank.
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: list[Callable[[], Any]] = []
        self._host_messages: list[tuple[float, Any]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Add functions to call after each reset (a worker joined or left).

        A typical one rescales the learning rate to the new ``hvd.size()``.

        Args:
            callbacks: functions of no arguments, called in the order registered.
        """
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called once the job has re-formed: :meth:`reset`, then every reset callback."""
        self._host_messages = []
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update_res: Any) -> None:
        """Take note of a host change that the launcher reported (``update_res``: what
        changed: ``"added"``, ``"removed"`` or ``"mixed"``)."""
        self._host_messages.append((timestamp, update_res))

    def commit(self) -> None:
        """Save the state in host memory, then check for host changes.

        Copying (possibly from a GPU) costs time: commit every few batches rather than every
        batch, trading per-batch cost against the steps lost when a worker fails.

        Raises:
            HostsUpdatedInterrupt: hosts were added or removed (see
                :meth:`check_host_updates`).
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank when the launcher has formed a new
        job (hosts added or removed) since this one.

        Rank 0 asks the launcher's store; its answer is broadcast, so that every rank raises
        at the same call.  Outside an elastic ``hora run`` this returns at once, without a
        collective.

        Raises:
            HostsUpdatedInterrupt: the job is about to re-form; ``skip_sync`` is True when
                workers only left (the survivors hold the same state already).
        """
        if not membership.is_elastic():
            return
        news = elastic_news() if self._rank() == 0 else None
        news = self._bcast_object(news)
        if news is None:
            return
        self.on_hosts_updated(news["time"], news["change"])
        raise HostsUpdatedInterrupt(news["change"] == "removed")

    def save(self) -> None:
        """Copy the state to host memory."""
        raise NotImplementedError(f"{type(self).__name__}.save")

    def restore(self) -> None:
        """Put back the last saved state, undoing every change made since."""
        raise NotImplementedError(f"{type(self).__name__}.restore")

    def sync(self) -> None:
        """Make every rank's state equal to rank 0's."""
        raise NotImplementedError(f"{type(self).__name__}.sync")

    def reset(self) -> None:
        """Adjust to a re-formed job, before :meth:`sync` (nothing by default)."""


class ObjectState(State):
    """State made of plain Python objects, given as keyword arguments.

    Each keyword becomes an attribute.  :meth:`save` keeps a deep copy of every attribute
    (so changing a list in place after a commit does not change the commit), :meth:`restore`
    puts a copy of the saved values back, and :meth:`sync` replaces them with rank 0's saved
    values (the last commit, not uncommitted changes).

    Args:
        bcast_object: ``bcast_object(obj)`` returns rank 0's ``obj`` on every rank.
        get_rank: returns this worker's rank.
        **kwargs: the attributes and their initial values (their first commit).

    Example::

        state = ObjectState(hvd.broadcast_object, hvd.rank, epoch=0, batch=0)
        state.epoch += 1
        state.commit()
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int],
                 **kwargs: Any) -> None:
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        """Commit a copy of every attribute given at construction."""
        self._saved_state = {name: copy.deepcopy(getattr(self, name))
                             for name in self._saved_state}

    def restore(self) -> None:
        """Set every attribute back to its last commit."""
        self._set_attrs()

    def sync(self) -> None:
        """Give every rank rank 0's committed attributes (by ``bcast_object``)."""
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        # a copy, so that changes after restore() leave the saved values for the next one
        for name, value in copy.deepcopy(self._saved_state).items():
            setattr(self, name, value)


def run_fn(func: Callable[..., Any], reset: Callable[[], None]) -> Callable[..., Any]:
    """Wrap an elastic training function ``func(state, *args, **kwargs)`` in the recovery
    loop (Horovod's ``run_fn``); the bindings' ``elastic.run`` are this with their reset.

    The wrapper syncs ``state`` from rank 0, then calls ``func``.  On
    ``HorovodInternalError`` (a rank failed) it restores the last commit; on
    ``HostsUpdatedInterrupt`` it keeps the state as it is.  Either way it calls ``reset()``
    (leave this job, join the next one), ``state.on_reset()``, syncs again (unless only
    workers left) and calls ``func`` again.  ``func``'s return value is returned.

    Args:
        func: the training function; its first argument is the :class:`State`.
        reset: leaves the current job and joins the next (``shutdown(); init()``).
    """
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError as e:
                log.warning("elastic: %s; restoring the last commit and re-forming the job",
                            e)
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as e:
                skip_sync = e.skip_sync
            reset()
            state.on_reset()
    return wrapper


def _reset() -> None:
    from ..core import init, shutdown
    shutdown()
    init()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate an elastic training function ``func(state, ...)``: see :func:`run_fn`.

    Example::

        @hvd.elastic.run
        def train(state):
            for state.epoch in range(state.epoch, epochs):
                ...
                state.commit()

        train(hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, epoch=0))
    """
    return run_fn(func, _reset)


def _internal_error_names() -> set[str]:
    names, todo = set(), [HoraInternalError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def unwrap_internal_errors(func: Callable[..., Any],
                           kinds: tuple[type[BaseException], ...] = (Exception,)
                           ) -> Callable[..., Any]:
    """``func``, raising ``HorovodInternalError`` for an error of ``kinds`` whose message
    names a ``HoraInternalError``: a collective that fails inside a compiled step (a
    ``tf.function``, a jitted JAX step) reaches Python wrapped in the framework's own error,
    which :func:`run_fn` would otherwise not recognize as a failed rank."""
    @functools.wraps(func)
    def unwrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except HoraError:
            raise
        except kinds as e:
            message = str(e)
            if any(name in message for name in _internal_error_names()):
                raise HorovodInternalError(message) from e
            raise
    return unwrapped
