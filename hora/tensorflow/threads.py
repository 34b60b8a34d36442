"""TensorFlow's inter-op threads, which hora's graph-mode collectives wait on.

A collective inside a graph is a ``tf.numpy_function`` node, and TensorFlow runs such a node
on one thread of its inter-op pool, which the node keeps until the collective completes.  In
a ``tf.compat.v1`` graph (unlike a ``tf.function``, whose stateful ops run one at a time in
program order) every collective whose inputs are ready may start at once, in whatever order
each rank's executor picks.  When a rank's threads are all held by collectives that another
rank has not reached, and that rank's threads by others again, no collective can complete:
ranks differ only in the order they start them, yet the job is stuck.  Horovod's kernels are
asynchronous and hold no thread while they wait; a Python node cannot be.

So a rank needs at least as many inter-op threads as collectives that may wait at once.
TensorFlow's pool has one thread per CPU by default (two on a small machine: two independent
allreduces started in different orders on two ranks were enough to stop a job).  hora raises
that default to :data:`THREADS` (``TF_NUM_INTEROP_THREADS``, which TensorFlow reads when it
makes its pools; a value the user set is kept), and warns, once per graph, when a graph
holds more collectives than that: they can deadlock if they run in one ``Session.run``.
Idle pool threads sleep; they cost memory for their stacks, not CPU.

Layer: tensorflow (a binding).
"""
from __future__ import annotations

import os
import sys
import warnings
import weakref
from typing import Any

__all__ = ["THREADS", "widen_default_pool", "pool_size", "note_collective"]

# Enough for the collectives one step of a v1 graph starts side by side (Horovod's own
# tests start about 20 at once; a training graph reduces its gradients in a few grouped
# nodes), with room to spare; the pool's threads are made once per process.
THREADS = 64
_VAR = "TF_NUM_INTEROP_THREADS"


def widen_default_pool() -> None:
    """Ask TensorFlow for :data:`THREADS` inter-op threads (or one per CPU where that is
    more), unless ``TF_NUM_INTEROP_THREADS`` is set already.  Only pools that TensorFlow has
    not made yet get the new size: call before the first op and the first Session."""
    if not os.environ.get(_VAR):
        os.environ[_VAR] = str(max(THREADS, os.cpu_count() or 1))


def pool_size() -> int:
    """The inter-op threads of a Session made without a thread count of its own."""
    try:
        value = int(os.environ.get(_VAR, "0"))
    except ValueError:
        value = 0
    return value if value > 0 else os.cpu_count() or 1


_warned: weakref.WeakSet[Any] = weakref.WeakSet()


def note_collective(graph: Any, count: int) -> None:
    """``graph`` (a ``tf.compat.v1`` graph, not a function's) now holds ``count``
    collectives: warn once when that is more than the threads that may wait on them."""
    threads = pool_size()
    if count <= threads or graph in _warned:
        return
    _warned.add(graph)
    warnings.warn(
        f"this tf.compat.v1 graph holds {count} hora collectives, more than TensorFlow's "
        f"{threads} inter-op threads ({_VAR}): each collective holds a thread while it "
        f"waits for the other ranks, so more than {threads} of them run in one Session.run "
        f"can deadlock.  Group them (hvd.grouped_allreduce, grouped_allgather: one node for "
        f"many tensors) or set {_VAR} above {count} before TensorFlow starts.",
        RuntimeWarning, stacklevel=_user_level())


def _user_level() -> int:
    """The ``stacklevel`` of the first caller outside hora and TensorFlow."""
    inside = tuple(os.path.dirname(m.__file__) + os.sep
                   for m in (sys.modules["hora"], sys.modules["tensorflow"]))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level
