"""What every framework binding's gradient reduction shares, written once.

A binding (``hora.torch``, ``hora.tensorflow``, ``hora.keras``) converts tensors and hooks
its framework's optimizer; the rules below are the same for all of them, so they live here:

- :func:`check_reduce_options` and :func:`check_passes`: the option checks Horovod makes, with
  its messages;
- :func:`resolve_groups` and :func:`plan_groups`: ``num_groups``/``groups`` (an int: that
  many contiguous groups; lists of variables: those groups, then one group per variable in
  none of them);
- :func:`predivide_scales`: how ``gradient_predivide_factor`` splits an Average's scaling
  around the sum;
- :func:`noname`: the name of a gradient that its binding could not name, the same on every
  rank;
- :class:`LocalAccumulation`: when, with ``backward_passes_per_step``, gradients are
  reduced and applied (the counting; the binding keeps the sums in its own tensors);
- :class:`Compressor`, :class:`NoneCompressor`, :class:`FP16Compressor`: Horovod's
  compression, over a binding's :class:`Casts`, offered as :class:`Compressions`;
- :func:`block_rows` and :func:`reducescatter_grad_factor`: a reducescatter's split of the
  rows and Horovod's scaling of its gradient; :func:`rows_of`: the rows an allgather takes
  from a tensor;
- :func:`broadcast_arrays`: many broadcasts submitted before any is waited for, the way a
  model's and an optimizer's state go from the root to every rank.

Layer: core (knows no framework; arrays here are NumPy's or opaque).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from . import ops
from .fusion import split_even
from .messages import Average, Sum
from .process_sets import ProcessSet, global_process_set

__all__ = ["check_reduce_options", "check_passes", "resolve_groups", "plan_groups",
           "predivide_scales", "noname", "LocalAccumulation", "Casts", "Compressor",
           "NoneCompressor", "FP16Compressor", "Compressions", "block_rows",
           "reducescatter_grad_factor", "rows_of", "broadcast_arrays"]


# -- options --------------------------------------------------------------------------------
def check_reduce_options(op: int, gradient_predivide_factor: float) -> None:
    """Raise ValueError for options that cannot go together (Horovod's rule)."""
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average "
                         f"(op={op!r}, gradient_predivide_factor={gradient_predivide_factor})")


def check_passes(passes: Any) -> int:
    """``backward_passes_per_step``, checked: a positive int."""
    if isinstance(passes, bool) or not isinstance(passes, (int, np.integer)) or passes < 1:
        raise ValueError(f"backward_passes_per_step must be a positive int, got {passes!r}")
    return int(passes)


def predivide_scales(op: int, gradient_predivide_factor: float) -> tuple[float, float]:
    """``(prescale, postscale)`` for a gradient allreduce.

    With Average the gradients are multiplied by ``1 / f`` before the sum and by ``f`` after
    it (the engine then divides by the set's size): a low-precision sum overflows less.
    Other ops are not scaled."""
    if op == Average:
        f = float(gradient_predivide_factor)
        return 1.0 / f, f
    return 1.0, 1.0


# -- groups ---------------------------------------------------------------------------------
def resolve_groups(num_groups: int, groups: Any, is_member: Callable[[Any], bool],
                   member_kind: str, stacklevel: int = 3) -> int | list[list[Any]] | None:
    """The ``groups`` to use: None (no grouping), an int > 0, or a list of lists.

    ``num_groups`` (deprecated) stands for ``groups`` when ``groups`` is None.  ``is_member``
    says whether an element of a list may be grouped (a tensor, a variable) and
    ``member_kind`` names such elements in the error.  ``stacklevel`` is the deprecation
    warning's, counted from here (3: the caller's caller).

    Raises:
        ValueError: ``groups`` is neither a non-negative int nor a list of lists of members,
            or a member appears twice.
    """
    if num_groups:
        warnings.warn("num_groups is deprecated; pass groups=<int> instead",
                      DeprecationWarning, stacklevel=stacklevel)
        if groups is None:
            groups = num_groups
    if groups is None:
        return None
    if isinstance(groups, bool) or not isinstance(groups, (int, list)):
        raise ValueError(f"groups should be a non-negative integer or a list of lists of "
                         f"{member_kind}, got {groups!r}")
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError(f"groups should be a non-negative integer, got {groups}")
        return groups or None
    seen: set[int] = set()
    for group in groups:
        for member in group:
            if not is_member(member):
                raise ValueError(f"groups must consist of {member_kind}, got "
                                 f"{type(member).__name__}")
            if id(member) in seen:
                raise ValueError("A parameter can only appear once in groups.")
            seen.add(id(member))
    return [list(g) for g in groups]


def plan_groups(members: Sequence[Any], groups: int | list[list[Any]] | None
                ) -> list[list[int]]:
    """Indices into ``members`` in the groups that are reduced, one collective each.

    ``groups`` as :func:`resolve_groups` returns it.  None: one group of everything.  An int
    n: n contiguous groups, as even as can be (empty ones dropped).  Lists: the members of
    each list that are in ``members`` (by identity), in list order, then one group for each
    member in none of the lists."""
    indices = list(range(len(members)))
    if not indices:
        return []
    if groups is None:
        return [indices]
    if isinstance(groups, int):
        return [g for g in split_even(indices, groups) if g]
    position = {id(m): i for i, m in enumerate(members)}
    out = []
    for group in groups:
        chosen = [position.pop(id(m)) for m in group if id(m) in position]
        if chosen:
            out.append(chosen)
    left = set(position.values())
    return out + [[i] for i in indices if i in left]


def noname(group: int, index: int) -> str:
    """The allreduce name of the ``index``-th gradient of parameter group ``group`` when
    nothing better names it (Horovod's ``allreduce.noname.<group>.<index>``)."""
    return f"allreduce.noname.{group}.{index}"


# -- backward_passes_per_step -------------------------------------------------------------
class LocalAccumulation:
    """When gradients accumulated over ``passes`` backward passes are reduced and applied.

    Each :meth:`add` counts one pass; it returns True on the pass that completes a step,
    when the binding reduces its accumulated sums (divided by :attr:`divisor`) and applies
    them, and the count starts again.  With ``passes == 1`` every pass is a step.  For
    graph code that cannot branch in Python, :attr:`passes` and :attr:`divisor` give the
    same rule to write as a conditional.

    Args:
        passes: ``backward_passes_per_step``.
        average: ``average_aggregated_gradients``: divide the sums by ``passes``.
    """

    def __init__(self, passes: int, average: bool = False):
        self.passes = check_passes(passes)
        self.divisor = float(self.passes) if average else 1.0
        self.count = 0

    def add(self) -> bool:
        """Count one backward pass; True when it completes a step."""
        self.count += 1
        if self.count < self.passes:
            return False
        self.count = 0
        return True

    def reset(self) -> None:
        """Forget the passes counted since the last step."""
        self.count = 0


# -- compression ----------------------------------------------------------------------------
class Casts(Protocol):
    """A framework's dtype casts, as the compressors need them (a binding subclasses it;
    :meth:`dtype` is ``tensor.dtype`` unless it says otherwise)."""

    def is_float(self, tensor: Any) -> bool:
        """A floating-point tensor other than float16."""

    def dtype(self, tensor: Any) -> Any:
        """The tensor's dtype."""
        return tensor.dtype

    def cast(self, tensor: Any, dtype: Any) -> Any:
        """The tensor as ``dtype`` (``None``: float16)."""


class Compressor:
    """Turns a tensor into what is sent (``compress``) and back (``decompress``).

    Subclasses are used as classes (``Compression.fp16.compress(t)``), as in Horovod."""

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:
        """Returns ``(tensor_to_send, context)``."""
        raise NotImplementedError

    @classmethod
    def decompress(cls, tensor: Any, ctx: Any) -> Any:
        """Returns the tensor that ``compress`` was given, from what was sent and its
        context."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are (the default)."""

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, None]:
        return tensor, None

    @classmethod
    def decompress(cls, tensor: Any, ctx: None) -> Any:
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 (half the bytes), restoring their dtype
    afterwards; other dtypes go as they are (Horovod's rule).  A binding subclasses it with
    its :attr:`casts`."""

    casts: ClassVar[Casts]

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:
        if cls.casts.is_float(tensor):
            return cls.casts.cast(tensor, None), cls.casts.dtype(tensor)
        return tensor, None

    @classmethod
    def decompress(cls, tensor: Any, ctx: Any) -> Any:
        return tensor if ctx is None else cls.casts.cast(tensor, ctx)


class Compressions:
    """Horovod's ``Compression``: ``Compression.none`` and ``Compression.fp16``.  A binding
    subclasses it, setting :attr:`fp16` to its :class:`FP16Compressor`."""
    none: type[Compressor] = NoneCompressor
    fp16: type[Compressor]


# -- the collectives' shapes and gradients --------------------------------------------------
def block_rows(rows: int, size: int, rank: int) -> int:
    """The rows that a reducescatter of ``rows`` rows leaves on ``rank`` of ``size`` ranks:
    an even split, the first ``rows % size`` ranks one row more."""
    q, extra = divmod(rows, size)
    return q + 1 if rank < extra else q


def reducescatter_grad_factor(op: int, prescale_factor: float, postscale_factor: float,
                              size: int) -> float:
    """What a reducescatter's gathered output gradient is multiplied by (Horovod's
    definition, kept for drop-in compatibility): the scale factors, times the set's
    ``size`` for Sum."""
    return prescale_factor * postscale_factor * (size if op == Sum else 1)


def rows_of(shape: Sequence[int]) -> int:
    """The rows an allgather takes from a tensor of ``shape``: its first dimension (a
    scalar is one row).  An allgather's gradient gives each rank back that many rows."""
    return shape[0] if len(shape) else 1


# -- state broadcast ------------------------------------------------------------------------
def broadcast_arrays(arrays: Sequence[np.ndarray], root_rank: int,
                     process_set: ProcessSet = global_process_set,
                     names: Sequence[str] | None = None) -> list[np.ndarray]:
    """``root_rank``'s value of every array, on every member of ``process_set``.

    Every broadcast is submitted before any is waited for, so the engine fuses them and
    their order within the call does not matter.  ``names`` (optional) name the collectives;
    without them they get automatic names, which are the same on every rank as long as
    every rank makes the same calls."""
    if names is not None and len(names) != len(arrays):
        raise ValueError(f"broadcast_arrays: {len(arrays)} arrays but {len(names)} names")
    handles = [ops.broadcast_async(a, root_rank,
                                   name=None if names is None else names[i],
                                   process_set=process_set)
               for i, a in enumerate(arrays)]
    return [np.asarray(h.wait(), dtype=a.dtype).reshape(np.shape(a))
            for h, a in zip(handles, arrays)]
