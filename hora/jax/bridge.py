"""The bridge under ``hora.jax``'s collectives: argument checks, arrays to NumPy and back
(eagerly, or as one ordered ``io_callback`` under a trace), names fixed at trace time, the
``custom_vjp`` wrapper, and Horovod's compression with JAX's casts.  See
:mod:`hora.jax.mpi_ops` for what each of these means to a user.

Layer: jax (a binding: it converts arrays and never touches a socket).
"""
from __future__ import annotations

import re
import weakref
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from ..core import messages
from ..core.gradients import Casts, Compressions, Compressor
from ..core.gradients import FP16Compressor as _FP16
from ..core.ops import tells_peers
from ..core.process_sets import ProcessSet, global_process_set, set_id_of

__all__ = ["Compression", "Compressor", "FP16Compressor", "ps_of", "check_array", "check_op",
           "resolve_op", "stage", "host_dtype", "is_traced", "tracing", "tells_peers_eagerly",
           "collective_name", "run", "differentiable", "zero_cotangent"]

# -- compression -------------------------------------------------------------------------------
class _JaxCasts(Casts):
    def is_float(self, tensor: Any) -> bool:
        return jnp.issubdtype(tensor.dtype, jnp.floating) and tensor.dtype != jnp.float16

    def cast(self, tensor: Any, dtype: Any) -> Any:
        return tensor.astype(jnp.float16 if dtype is None else dtype)


class FP16Compressor(_FP16):
    """Sends floating-point arrays as float16, restoring their dtype afterwards."""
    casts = _JaxCasts()


class Compression(Compressions):
    """``Compression.none`` and ``Compression.fp16`` (Horovod's names)."""
    fp16 = FP16Compressor


# -- arrays, tracing, names --------------------------------------------------------------------
def ps_of(process_set: Optional[ProcessSet]) -> ProcessSet:
    return global_process_set if process_set is None else process_set


def check_array(x: Any, what: str) -> jax.Array:
    if not isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, bool)):
        raise TypeError(f"{what}: expected a jax.Array, got {type(x).__name__}")
    if not isinstance(x, jax.Array):
        x = jnp.asarray(x)
    if x.dtype != jnp.bfloat16 and np.dtype(x.dtype).kind not in "biufc":
        raise TypeError(f"{what}: unsupported dtype {x.dtype}")
    return x


def check_op(op: int, what: str) -> None:
    if op == messages.Adasum:
        raise NotImplementedError(f"{what}: the Adasum op is not implemented in hora yet")
    if op not in messages.OP_NAMES:
        raise ValueError(f"{what}: unknown reduce op {op!r}")


def resolve_op(op: Optional[int], average: Optional[bool]) -> int:
    if average is not None:
        if op is not None:
            raise ValueError("pass either op= or the deprecated average=, not both")
        return messages.Average if average else messages.Sum
    return messages.Average if op is None else op


def stage(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x


def host_dtype(dtype: Any) -> np.dtype:
    return np.dtype(np.float32) if dtype == jnp.bfloat16 else np.dtype(dtype)


def is_traced(xs: Sequence[Any]) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in xs)


try:    # JAX has no public "is anything tracing?"; without it, assume something may be
    from jax._src.core import trace_state_clean as _clean
except ImportError:                                               # pragma: no cover
    def _clean() -> bool:
        return False


def tracing() -> bool:
    """Whether a trace or a transformation (jit, grad, ...) is active: then a call with no
    array inputs (barrier, join) is traced, and a differentiable one needs its rule."""
    return not _clean()


def tells_peers_eagerly(kind: int) -> Callable:
    """hora.core's ``tells_peers`` for calls made eagerly: a failed argument check is told to
    the other ranks.  While tracing nothing is submitted, so there is nothing to tell."""
    def wrap(fn):
        told = tells_peers(kind)(fn)

        def call(*args, **kwargs):
            return (fn if tracing() else told)(*args, **kwargs)
        call.__name__, call.__doc__, call.__wrapped__ = fn.__name__, fn.__doc__, fn
        call.__qualname__ = fn.__qualname__
        return call
    return wrap


# collectives traced so far in each outermost trace (one jit trace of one function), per set
_counts: weakref.WeakKeyDictionary[Any, dict[int, int]] = weakref.WeakKeyDictionary()


def _outer_trace(xs: Sequence[Any]) -> Any:
    trace = next(x for x in xs if isinstance(x, jax.core.Tracer))._trace
    # a lax.cond branch, a custom_vjp rule or a nested jit is traced inside its caller's
    # trace; count in the outermost one so their collectives get distinct names
    while getattr(trace, "parent_trace", None) is not None and \
            hasattr(trace.parent_trace, "frame"):
        trace = trace.parent_trace
    return trace


def _function_name(trace: Any) -> str:
    try:
        src = trace.frame.debug_info.func_src_info or "jit"
    except AttributeError:
        src = "jit"
    return re.sub("[^a-zA-Z0-9_]", "_", src.split(" ")[0]) or "jit"


def collective_name(name: Optional[str], prefix: str, xs: Sequence[Any],
                    process_set: Optional[ProcessSet]) -> Optional[str]:
    """``name``; eagerly None (the core's automatic names); under a trace
    ``<prefix>.<function>.<k>``, fixed now (see the module docstring)."""
    if name is not None:
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        return name
    if not is_traced(xs):
        return None
    ps = set_id_of(process_set)
    trace = _outer_trace(xs)
    counts = _counts.setdefault(trace, {})
    k = counts.get(ps, 0)
    counts[ps] = k + 1
    function = _function_name(trace)
    return f"{prefix}.{function}.{k}" if ps == 0 else f"{prefix}.{function}.ps{ps}.{k}"


def run(compute: Callable[..., Sequence[np.ndarray]], inputs: Sequence[jax.Array],
         specs: Sequence[tuple[tuple[int, ...], Any]], what: str,
         traced: Optional[bool] = None) -> list[jax.Array]:
    """``compute(*arrays)`` (hora's core on NumPy arrays) on ``inputs``: at once eagerly, as
    one ordered ``io_callback`` whose outputs are ``specs`` ((shape, dtype) each) under a
    trace.  Outputs come back in their spec's dtype."""
    traced = is_traced(inputs) if traced is None else traced
    if not traced:
        arrays = compute(*[np.asarray(x) for x in inputs])
        results = [jnp.asarray(np.asarray(o, dtype=host_dtype(d))) for o, (_, d) in
                   zip(arrays, specs)]
        return [o.astype(d) if o.dtype != d else o for o, (_, d) in zip(results, specs)]

    host = [(tuple(s), host_dtype(d)) for s, d in specs]

    def callback(*arrays):
        outs = compute(*arrays)
        checked = []
        for o, (shape, dtype) in zip(outs, host):
            o = np.asarray(o, dtype=dtype)
            if o.shape != shape:
                raise ValueError(
                    f"hora.jax.{what}: the result has shape {o.shape} but {shape} was declared "
                    f"when the function was traced: inside jax.jit every rank must pass the "
                    f"same shape (call it outside jit for rows that differ by rank)")
            checked.append(o)
        return tuple(checked)

    outs = io_callback(callback, tuple(jax.ShapeDtypeStruct(s, d) for s, d in host),
                       *inputs, ordered=True)
    return [o.astype(d) if o.dtype != d else o for o, (_, d) in zip(outs, specs)]


def differentiable(primal: Callable[..., tuple], bwd: Callable, keep_inputs: bool = False
                    ) -> Callable[..., tuple]:
    """``primal`` with ``bwd`` as its backward rule (``jax.custom_vjp``; ``bwd`` gets the
    inputs as residuals when ``keep_inputs``).  Called with no trace or transformation
    active, ``primal`` runs directly: nothing can differentiate it then, and going through
    ``custom_vjp`` would cost about half a millisecond per eager call."""
    def call(*xs):
        if not tracing():
            return primal(*xs)
        f = jax.custom_vjp(primal)
        f.defvjp(lambda *xs: (primal(*xs), xs if keep_inputs else None), bwd)
        return f(*xs)
    return call


def zero_cotangent(y: Any) -> bool:
    return not jnp.issubdtype(y.dtype, jnp.inexact)
