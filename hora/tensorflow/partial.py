"""Horovod's ``PartialDistributedGradientTape``: a DistributedGradientTape that leaves some
Keras layers' gradients local.

A model whose layers are partly per-rank (an embedding table that each rank keeps for
itself, a head trained on local data) reduces the gradients of the shared weights only: the
gradients of the local layers' trainable weights stay on their rank, divided by the number of
ranks unless ``scale_local_gradients=False`` (Horovod's rule, which keeps a local gradient on
the scale of an averaged one).  This is :func:`hora.tensorflow.DistributedGradientTape` with
each of those weights given to its ``register_local_source``.

Layer: tensorflow (a framework binding).  Imports hora.core and its siblings only.
"""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from ..core.messages import Average
from ..core.process_sets import ProcessSet, global_process_set
from .compression import Compression
from .training import DistributedGradientTape

__all__ = ["PartialDistributedGradientTape"]


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = '',
                                   device_sparse: str = '', compression=Compression.none,
                                   sparse_as_dense: bool = False, op: int = Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups=None, process_set: ProcessSet = global_process_set,
                                   local_layers: Any = None,
                                   scale_local_gradients: bool = True):
    """A tape that wraps ``gradtape`` as :func:`DistributedGradientTape` does, except that
    the gradients of ``local_layers``' trainable weights are not reduced.

    Args:
        gradtape: the tf.GradientTape that recorded the forward pass.
        local_layers: a Keras layer or a list of them (None: none, and the tape is a plain
            DistributedGradientTape).  Their trainable weights' gradients stay local.
        scale_local_gradients: divide the local gradients by the number of ranks in
            ``process_set`` (Horovod's default); False leaves them as computed.
        device_dense, device_sparse, compression, sparse_as_dense, op,
        gradient_predivide_factor, num_groups, groups, process_set: as for
            :func:`DistributedGradientTape`, for the gradients that are reduced.

    Returns:
        The wrapping tape; its ``gradient`` returns the gradients in the order of the
        sources, and ``get_local_and_global_gradients`` splits them into the two kinds.

    Raises:
        ValueError: an item of ``local_layers`` is not a Keras layer.

    Example:
        >>> with tf.GradientTape() as tape:
        ...     loss = loss_fn(y, model(x, training=True))
        >>> tape = hvd.PartialDistributedGradientTape(tape, local_layers=[model.layers[-1]])
        >>> grads = tape.gradient(loss, model.trainable_variables)
        >>> optimizer.apply_gradients(zip(grads, model.trainable_variables))
    """
    layers = _local_layers(local_layers)
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    for layer in layers:
        for weight in layer.trainable_weights:
            tape.register_local_source(weight)
    return tape


def _local_layers(local_layers: Any) -> list[Any]:
    """``local_layers`` as a list of Keras layers (Horovod's accepted forms)."""
    layer_type = tf.keras.layers.Layer
    if local_layers is None:
        return []
    if isinstance(local_layers, layer_type):
        return [local_layers]
    layers = list(local_layers)
    wrong = [layer for layer in layers if not isinstance(layer, layer_type)]
    if wrong:
        raise ValueError(f"local_layers must be Keras layers (tf.keras.layers.Layer), got "
                         f"{', '.join(type(layer).__name__ for layer in wrong)}")
    return layers
