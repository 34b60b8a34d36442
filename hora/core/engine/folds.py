"""The board's arithmetic: reductions in rank order, which give the same bits on whichever rank
computes them, and the copies in and out of the board's areas; and :data:`REDUCE`, each op's
ufunc, which the executor and the small allreduces reduce with too.  Pure: numpy on arrays
it is given.

Layer: core.
"""
import numpy as np

from ..fusion import NUMPY
from ..messages import Average, Max, Min, Product, Sum

__all__ = ["REDUCE", "add_up", "times", "fold", "pack", "copy_out"]

# An op's reduction of two arrays, elementwise.  Average adds: each path divides the sum by
# the count once, after it, together with the postscale.
REDUCE = {Sum: np.add, Average: np.add, Min: np.minimum, Max: np.maximum, Product: np.multiply}


def add_up(view, t, at, steps, acc):
    """``acc`` plus the numbers of ``view`` at ``at + d`` for each ``d`` of ``steps``, in
    order, rounded to the dtype of the one-number scratch ``t`` after each addition (see
    :meth:`Board.scalar`)."""
    for d in steps:
        t[0] = acc + view[at + d]
        acc = t[0]
    return acc


def times(t, acc, factor):
    """The number ``acc`` times ``factor`` as :func:`scale` rounds it: by the factor rounded
    to the dtype of the scratch ``t``, then the product rounded."""
    if factor != 1:
        t[0] = factor
        t[0] = acc * t[0]
        acc = t[0]
    return acc


def fold(req, inputs, out):
    """``out`` = ``req``'s op over ``inputs`` (two or more), in their order: the same bits
    wherever it is computed."""
    fn = REDUCE[req.op]
    if out.size == 1 and (len(inputs) > 2 or inputs[0] is out):
        # numpy's ufuncs take three times as long (0.65 us against 0.2) when a one-element
        # output is also an input: the partial results go to new arrays instead
        acc = fn(inputs[0], inputs[1])
        for x in inputs[2:]:
            acc = fn(acc, x)
        out[...] = acc
        return
    fn(inputs[0], inputs[1], out=out)
    for x in inputs[2:]:
        fn(out, x, out=out)


def copy_out(out, result):
    """``result`` (the board's result area) copied into ``out``, or into a new array when
    ``out`` is None; returns the copy."""
    if out is None:
        return result.copy()
    np.copyto(out, result)
    return out


def pack(dst, arrays):
    """Copy ``arrays`` one after another into the flat ``dst``."""
    if len(arrays) == 1:            # the common call: copyto costs half of a concatenate
        a = arrays[0]
        np.copyto(dst if a.ndim == 1 else dst.reshape(a.shape), a)
    else:
        NUMPY.concat_into(arrays, dst)
