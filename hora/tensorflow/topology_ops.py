"""``hora.tensorflow``'s ops that are not collectives on tensors: ``join`` and ``barrier``,
and Horovod's ops that read the job's topology (size, rank, process-set membership) when
the graph runs rather than when it is built, so that a graph built in one place runs right
in another.

A process set is named here by its id (``process_set_id``), as in Horovod's ops.  For a set
this job has not registered, ``size_op`` and ``process_set_included_op`` return Horovod's
error value ``-3`` (``rank_op`` too, and ``-4`` on a set without this rank) rather than
raising, as Horovod's do.

Layer: tensorflow (a binding).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import tensorflow as tf

from .. import core
from ..core import process_sets as _sets
from ..core.process_sets import ProcessSet, global_process_set
from .bridge import refuse_xla, run

__all__ = ["join", "barrier", "size_op", "process_set_included_op", "local_size_op",
           "rank_op", "local_rank_op"]

# Horovod's values for a process set that cannot answer (horovod.common's basics)
UNKNOWN_SET = -3
FOREIGN_SET = -4


def join() -> tf.Tensor:
    """This rank has no more data: until every rank has joined it takes part in the others'
    allreduces with zeros.  Returns the last rank to join (an int32 scalar tensor)."""
    return run(lambda: [core.join()], [], [tf.int32], [tf.TensorShape([])], "join")[0]


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of ``process_set`` has reached the barrier (in a graph: once
    the node has run)."""
    run(lambda: [core.barrier(process_set=process_set) or 0], [], [tf.int32],
        [tf.TensorShape([])], "barrier", process_set)


def _topology_op(read: Callable[[], int], name: str | None) -> tf.Tensor:
    """An int32 scalar read when the graph runs, not when it is built."""
    if tf.executing_eagerly():
        return tf.constant(read(), dtype=tf.int32)
    refuse_xla(name or "topology op")
    out = tf.numpy_function(lambda: np.int32(read()), [], tf.int32, stateful=True, name=name)
    out.set_shape([])
    return out


def _set(process_set_id: int) -> ProcessSet | None:
    """The set registered in this job under ``process_set_id`` (None: no such set)."""
    if process_set_id == 0:
        return global_process_set
    core.size()                     # raises NotInitializedError before hora.init()
    return next((s for s in _sets.registered_sets()
                 if s.process_set_id == process_set_id), None)


def _read_set(process_set_id: int, answer: Callable[[ProcessSet], int]) -> Callable[[], int]:
    def read() -> int:
        process_set = _set(process_set_id)
        return UNKNOWN_SET if process_set is None else answer(process_set)
    return read


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The number of ranks (in the process set ``process_set_id``), read when the graph
    runs; ``-3`` for an unknown set."""
    return _topology_op(_read_set(process_set_id, ProcessSet.size), name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 if this rank belongs to the process set ``process_set_id``, else 0 (``-3`` for an
    unknown set), read when the graph runs."""
    return _topology_op(_read_set(process_set_id, lambda s: int(s.included())), name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    """The number of ranks on this host, read when the graph runs."""
    return _topology_op(core.local_size, name)


def rank_op(name: str | None = None, process_set_id: int = 0) -> tf.Tensor:
    """This process's rank, read when the graph runs; with ``process_set_id`` (hora's
    addition; Horovod's op has no such argument), its rank in that set, ``-4`` if it is not
    a member, ``-3`` for an unknown set."""
    if process_set_id == 0:
        return _topology_op(core.rank, name)
    return _topology_op(_read_set(process_set_id, lambda s: s.rank() if s.included()
                                  else FOREIGN_SET), name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank on its host, read when the graph runs."""
    return _topology_op(core.local_rank, name)
