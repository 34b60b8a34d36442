"""Training with TensorFlow: averaged gradients and rank 0's initial state, with Horovod's names.

``DistributedGradientTape`` averages a tape's gradients over the ranks and
``broadcast_variables`` gives every rank the root's variables; for ``tf.compat.v1`` code,
``training_v1`` adds ``DistributedOptimizer``, ``broadcast_global_variables`` and
``BroadcastGlobalVariablesHook``.  Everything works eagerly and inside
``tf.function``; the collectives are :mod:`hora.tensorflow.mpi_ops`'s (``tf.numpy_function``
nodes on hora.core's NumPy API).

Few blocking nodes, in a fixed order.  A collective blocks the TensorFlow thread that runs
it until every rank has submitted it.  If a graph held several independent collectives,
TensorFlow could start them in different orders on different ranks, and with every inter-op
thread blocked the job would hang.  So one ``gradient`` call reduces all its dense gradients
with ONE grouped allreduce (one node) and all its sparse ones with ONE grouped allgather
(values and indices); when ``groups`` splits the dense ones, the groups run one after the
other, in the order given, and the allgather after them, chained by control dependencies.
``tf.function`` already orders stateful nodes as written; the chain is what orders them in a
``tf.compat.v1`` graph (``DistributedOptimizer``).  ``broadcast_variables`` broadcasts every
variable from one node.

Layer: tensorflow (a framework binding).  Imports hora.core and its siblings.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from hora.core.gradients import (broadcast_arrays, check_reduce_options, plan_groups, predivide_scales,
                                 resolve_groups)
from hora.core.messages import Average, Sum
from hora.core.process_sets import ProcessSet, global_process_set

from . import mpi_ops
from .compression import Compression

__all__ = ["DistributedGradientTape", "broadcast_variables"]


# -- broadcast of many tensors as ONE op ---------------------------------------------------------
def _broadcast_all(tensors, root_rank, process_set):
    """``root_rank``'s values of ``tensors`` on every rank: every broadcast is submitted
    before any is waited for, eagerly at once, in a graph from one ``tf.numpy_function``
    node (bfloat16 travels as float32, which NumPy lacks)."""
    staged = [tf.cast(t, tf.float32) if t.dtype == tf.bfloat16 else t for t in tensors]

    def run(*arrays):
        return broadcast_arrays(arrays, root_rank, process_set)

    if tf.executing_eagerly():
        outs = [tf.convert_to_tensor(o) for o in run(*[t.numpy() for t in staged])]
    else:
        outs = tf.numpy_function(run, staged, [t.dtype for t in staged], stateful=True,
                                 name="HoraBroadcastVariables")
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]  # one comes bare
        for o, t in zip(outs, staged):
            o.set_shape(t.shape)
    return [tf.cast(o, t.dtype) if o.dtype != t.dtype else o for o, t in zip(outs, tensors)]


# -- broadcast_variables -------------------------------------------------------------------
def broadcast_variables(variables: Sequence[Any], root_rank: int,
                        process_set: ProcessSet = global_process_set, inplace: bool = False):
    """Assign ``root_rank``'s value of each variable to it on every rank.

    Args:
        variables: tf.Variables or Keras variables (``model.variables``,
            ``optimizer.variables``), the same list in the same order on every rank.
        root_rank: the rank whose values everyone takes.
        process_set: broadcast among these ranks only (default: every rank).
        inplace: accepted for Horovod's signature; the variables are assigned either way.

    Returns:
        In a graph (``tf.function``, ``tf.compat.v1``), the op that does it (``tf.group``);
        eagerly, None, with the values already assigned.

    Example:
        >>> hvd.broadcast_variables(model.variables, root_rank=0)
    """
    del inplace                   # one buffer per variable is copied either way
    if not isinstance(root_rank, (int, np.integer)):
        raise TypeError(f"broadcast_variables: root_rank must be an int, got {root_rank!r}")
    variables = list(variables)
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    values = _broadcast_all([tf.convert_to_tensor(v) for v in variables], int(root_rank),
                            process_set)
    assigns = [v.assign(x) for v, x in zip(variables, values)]
    return None if tf.executing_eagerly() else tf.group(*assigns)


# -- the gradient reduction shared by the tape and the optimizer ---------------------------
def _check_grouping(op, gradient_predivide_factor, num_groups, groups):
    """The options' checks (hora.core.gradients' rules); returns the groups to use."""
    check_reduce_options(op, gradient_predivide_factor)
    return resolve_groups(num_groups, groups, _is_variable, "variables", stacklevel=4)


def _is_variable(v):
    return isinstance(v, tf.Variable) or hasattr(v, "assign")


def _plan_groups(dense, variables, groups):
    """The dense gradients' indices (``dense`` is ``[(index, grad)]``), in the groups reduced
    one after the other (:func:`hora.core.gradients.plan_groups`)."""
    indices = [i for i, _ in dense]
    members = [variables[i] if variables is not None else g for i, g in dense]
    return [[indices[k] for k in group] for group in plan_groups(members, groups)]


class _Reducer:
    """Reduces a list of gradients over the ranks, as Horovod's allreduce_grads does:
    None stays None, IndexedSlices are allgathered (or densified with sparse_as_dense),
    dense gradients go through ``compression`` and grouped allreduces, one op after another."""

    def __init__(self, compression, sparse_as_dense, op, gradient_predivide_factor, groups,
                 process_set):
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.op = op
        self.groups = groups
        self.process_set = process_set
        self.prescale, self.postscale = predivide_scales(op, gradient_predivide_factor)

    def __call__(self, grads, variables=None):
        grads = list(grads)
        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                     for g in grads]
        # nothing to reduce: one rank, or a rank outside the set (Horovod's _allreduce_cond)
        if self.process_set.size() == 1 or not self.process_set.included():
            return grads
        out = [None] * len(grads)
        dense = [(i, g) for i, g in enumerate(grads)
                 if g is not None and not isinstance(g, tf.IndexedSlices)]
        sparse = [(i, g) for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
        after = []                                # the previous op's outputs: run after them
        for group in _plan_groups(dense, variables, self.groups):
            with tf.control_dependencies(after):
                reduced = self._dense([grads[i] for i in group])
            for i, r in zip(group, reduced):
                out[i] = r
            after = reduced
        if sparse:
            with tf.control_dependencies(after):
                for (i, _), r in zip(sparse, self._sparse([g for _, g in sparse])):
                    out[i] = r
        return out

    def _dense(self, grads):
        return mpi_ops.grouped_allreduce(grads, compression=self.compression, op=self.op,
                                         prescale_factor=self.prescale,
                                         postscale_factor=self.postscale,
                                         process_set=self.process_set)

    def _sparse(self, slices):
        if self.op not in (Average, Sum):
            raise NotImplementedError("only Sum and Average reduce tf.IndexedSlices; pass "
                                      "sparse_as_dense=True for other ops")
        if self.prescale != 1.0 or self.postscale != 1.0:
            raise NotImplementedError("gradient_predivide_factor is not supported with "
                                      "tf.IndexedSlices; pass sparse_as_dense=True")
        # values and indices of every slice from one node (mpi_ops.grouped_allreduce would
        # use two, unordered in a tf.compat.v1 graph)
        gathered = mpi_ops.grouped_allgather([s.values for s in slices] +
                                             [s.indices for s in slices],
                                             process_set=self.process_set)
        n = len(slices)
        out = []
        for s, values, indices in zip(slices, gathered[:n], gathered[n:]):
            if self.op == Average:
                values = values / tf.cast(self.process_set.size(), values.dtype)
            out.append(tf.IndexedSlices(values, indices, dense_shape=s.dense_shape))
        return out


# -- DistributedGradientTape ---------------------------------------------------------------
class _DistributedGradientTape(tf.GradientTape):
    """A tf.GradientTape whose ``gradient`` returns the gradients reduced over the ranks.

    A fixed subclass of tf.GradientTape (Horovod subclasses the wrapped tape's own class at
    run time): custom tape subclasses lose their overrides here."""

    def __init__(self, tape, reducer, persistent=False, watch_accessed_variables=True,
                 scale_local_gradients=True):
        super().__init__(persistent, watch_accessed_variables)
        self._tape = tape                 # the recording of the tape we wrap, if it has one
        self._reduce = reducer
        self._scale_local = scale_local_gradients
        self._local_sources = set()

    def register_local_source(self, source):
        """Leave this source's gradient local: not reduced, and divided by the number of
        ranks unless ``scale_local_gradients=False`` (Horovod)."""
        self._local_sources.add(id(source))

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """The gradients of ``target`` with respect to ``sources`` (any nest), averaged over
        the ranks (or reduced by the tape's ``op``); None where a source does not affect
        ``target``, as on every rank.  ``use_generic_names`` is accepted for Horovod's
        signature (hora names a graph's collectives after their tensors)."""
        del use_generic_names
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        out = tf.nest.flatten(grads)
        shared = [i for i, s in enumerate(flat_sources) if id(s) not in self._local_sources]
        for i, g in zip(shared, self._reduce([out[i] for i in shared],
                                             [flat_sources[i] for i in shared])):
            out[i] = g
        size = float(self._reduce.process_set.size())
        if self._scale_local and size > 1:
            for i, s in enumerate(flat_sources):
                if id(s) in self._local_sources and out[i] is not None:
                    g = out[i]
                    out[i] = (tf.IndexedSlices(g.values / size, g.indices, g.dense_shape)
                              if isinstance(g, tf.IndexedSlices) else g / size)
        return tf.nest.pack_sequence_as(sources, out)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names=False):
        """``(local, global)``: the ``(source, gradient)`` pairs of the registered local
        sources and of the others, gradients as :meth:`gradient` returns them."""
        grads = self.gradient(target, sources, output_gradients, use_generic_names)
        local, shared = [], []
        for s, g in zip(sources, grads):
            (local if id(s) in self._local_sources else shared).append((s, g))
        return local, shared


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = '',
                            device_sparse: str = '', compression=Compression.none,
                            sparse_as_dense: bool = False, op: int = Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups=None, process_set: ProcessSet = global_process_set,
                            scale_local_gradients: bool = True):
    """A tape that wraps ``gradtape``: its ``gradient`` averages the gradients over the ranks.

    Args:
        gradtape: the tf.GradientTape that recorded the forward pass (or a fresh one, used
            as the context manager instead of it).
        device_dense, device_sparse: accepted for Horovod's signature (hora reduces on the
            host).
        compression: Compression.none or Compression.fp16, for the dense gradients.
        sparse_as_dense: turn tf.IndexedSlices gradients into dense tensors before the
            allreduce; otherwise their values and indices are allgathered.
        op: Average (default) or Sum (or Min, Max, Product for dense gradients).
        gradient_predivide_factor: with Average, scale by 1/f before the sum and by f/size
            after it.
        num_groups: deprecated, as ``groups=num_groups``.
        groups: None (default): all dense gradients in one grouped allreduce.  An int n: n
            grouped allreduces of contiguous gradients.  A list of lists of variables: one per
            list, then one per variable in none of them.  Groups run in this order, one after
            the other.
        process_set: reduce among these ranks only (default: every rank).
        scale_local_gradients: divide the gradients of the sources given to
            ``register_local_source`` (which are not reduced) by the number of ranks.

    Example:
        >>> with tf.GradientTape() as tape:
        ...     loss = loss_fn(y, model(x, training=True))
        >>> tape = hvd.DistributedGradientTape(tape)
        >>> grads = tape.gradient(loss, model.trainable_variables)
        >>> optimizer.apply_gradients(zip(grads, model.trainable_variables))
    """
    del device_dense, device_sparse
    groups = _check_grouping(op, gradient_predivide_factor, num_groups, groups)
    reducer = _Reducer(compression, sparse_as_dense, op, gradient_predivide_factor, groups,
                       process_set)
    tape = _DistributedGradientTape(gradtape._tape, reducer, gradtape._persistent,
                                    gradtape._watch_accessed_variables, scale_local_gradients)
    tape._watched_variables = gradtape._watched_variables
    return tape
