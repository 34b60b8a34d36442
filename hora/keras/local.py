"""Variables that stay on their rank: the local layers of ``PartialDistributedOptimizer`` and the
variables given to ``register_local_var``, whose gradients are not reduced.  Shared by the
Keras 3 (:mod:`hora.keras.optimizer`) and Keras 2 (:mod:`hora.keras.keras2`) optimizers.

Layer: keras (a binding).
"""
from __future__ import annotations

from typing import Any

from hora.core.process_sets import ProcessSet


def with_local_layers(opt: Any, layers: list) -> Any:
    """``opt`` with every trainable weight of ``layers`` registered as local."""
    for layer in layers:
        for var in layer.trainable_weights:
            opt.register_local_var(var)
    return opt


def reduce_keeping_local(reduce: Any, grads: list, variables: list, local_ids: set,
                         scale_local: bool, process_set: ProcessSet) -> list:
    """``reduce(grads, variables)`` for the variables whose ``id`` is not in ``local_ids``;
    the others' gradients kept on their rank, divided by the set's size unless
    ``scale_local`` is False (Horovod's rule: a local gradient stays on the scale of an
    averaged one).  Shared by the Keras 3 and the Keras 2 (:mod:`hora.keras.keras2`)
    optimizers."""
    if not local_ids:
        return reduce(grads, variables)
    shared = [i for i, v in enumerate(variables) if id(v) not in local_ids]
    out = list(grads)
    for i, g in zip(shared, reduce([grads[i] for i in shared],
                                   [variables[i] for i in shared])):
        out[i] = g
    size = float(process_set.size())
    if scale_local and size > 1:
        for i, v in enumerate(variables):
            if id(v) in local_ids and out[i] is not None:
                out[i] = _scaled(out[i], 1.0 / size)
    return out


def local_layer_list(local_layers: Any, layer_type: type) -> list:
    """``local_layers`` (None, a layer, or a list of layers of ``layer_type``) as a list;
    ValueError for anything else (Horovod's accepted forms)."""
    if local_layers is None:
        return []
    if isinstance(local_layers, layer_type):
        return [local_layers]
    if isinstance(local_layers, (list, tuple)) and all(
            isinstance(x, layer_type) for x in local_layers):
        return list(local_layers)
    raise ValueError(f"local_layers should be a Keras layer or a list of Keras layers, "
                     f"got {local_layers!r}")


def _scaled(grad: Any, factor: float) -> Any:
    if type(grad).__name__ == "IndexedSlices":                    # TensorFlow's sparse rows
        return type(grad)(grad.values * factor, grad.indices, grad.dense_shape)
    return grad * factor
