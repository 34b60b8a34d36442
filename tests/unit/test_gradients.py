"""hora.core.gradients: the gradient-reduction rules every binding shares."""
import warnings

import numpy as np
import pytest

from hora.core import gradients as g
from hora.core.messages import Average, Sum


def test_predivide_scales_split_average_around_the_sum():
    pre, post = g.predivide_scales(Average, 4.0)
    assert (pre, post) == (0.25, 4.0)
    assert g.predivide_scales(Sum, 1.0) == (1.0, 1.0)


def test_predivide_factor_needs_average():
    g.check_reduce_options(Average, 2.0)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        g.check_reduce_options(Sum, 2.0)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_check_passes_rejects(bad):
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        g.check_passes(bad)


def test_plan_groups_int_is_contiguous_and_even():
    items = list("abcdefg")
    assert g.plan_groups(items, None) == [[0, 1, 2, 3, 4, 5, 6]]
    assert g.plan_groups(items, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert g.plan_groups(items, 10) == [[i] for i in range(7)]
    assert g.plan_groups([], 3) == []


def test_plan_groups_lists_then_leftovers_by_identity():
    a, b, c, d = (np.zeros(1) for _ in range(4))
    other = np.zeros(1)
    assert g.plan_groups([a, b, c, d], [[c, a], [other]]) == [[2, 0], [1], [3]]


def test_resolve_groups():
    a, b = np.zeros(1), np.zeros(1)
    is_arr = lambda x: isinstance(x, np.ndarray)  # noqa: E731
    assert g.resolve_groups(0, None, is_arr, "arrays") is None
    assert g.resolve_groups(0, 0, is_arr, "arrays") is None
    assert g.resolve_groups(0, [[a], [b]], is_arr, "arrays") == [[a], [b]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert g.resolve_groups(2, None, is_arr, "arrays") == 2
    assert [w.category for w in caught] == [DeprecationWarning]
    with pytest.raises(ValueError, match="only appear once"):
        g.resolve_groups(0, [[a], [a]], is_arr, "arrays")
    with pytest.raises(ValueError, match="consist of arrays"):
        g.resolve_groups(0, [["x"]], is_arr, "arrays")
    with pytest.raises(ValueError, match="non-negative"):
        g.resolve_groups(0, -1, is_arr, "arrays")


def test_local_accumulation_counts_passes():
    acc = g.LocalAccumulation(3, average=True)
    assert [acc.add() for _ in range(7)] == [False, False, True, False, False, True, False]
    assert acc.divisor == 3.0
    acc.reset()
    assert [acc.add() for _ in range(3)] == [False, False, True]
    assert g.LocalAccumulation(1).add() and g.LocalAccumulation(2).divisor == 1.0


class _NumpyCasts:
    def is_float(self, t):
        return np.issubdtype(t.dtype, np.floating) and t.dtype != np.float16

    def dtype(self, t):
        return t.dtype

    def cast(self, t, dtype):
        return t.astype(np.float16 if dtype is None else dtype)


class _FP16(g.FP16Compressor):
    casts = _NumpyCasts()


def test_fp16_compressor_round_trip():
    x = np.array([1.5, -2.25, 3.0], dtype=np.float64)
    sent, ctx = _FP16.compress(x)
    assert sent.dtype == np.float16 and ctx == np.float64
    back = _FP16.decompress(sent, ctx)
    assert back.dtype == np.float64 and np.array_equal(back, x)
    ints = np.arange(3, dtype=np.int32)
    sent, ctx = _FP16.compress(ints)
    assert sent is ints and ctx is None and _FP16.decompress(sent, ctx) is ints
    assert g.NoneCompressor.compress(x) == (x, None)


@pytest.mark.parametrize("rows,size", [(0, 3), (2, 3), (7, 3), (9, 3), (5, 1), (4, 8)])
def test_block_rows_is_the_even_split_first_ranks_first(rows, size):
    # the split written out: deal the rows to the ranks one at a time, rank 0 first
    dealt = [0] * size
    for i in range(rows):
        dealt[i % size] += 1
    assert [g.block_rows(rows, size, r) for r in range(size)] == dealt


def test_reducescatter_grad_factor_scales_and_multiplies_sum_by_size():
    assert g.reducescatter_grad_factor(Sum, 2.0, 0.5, 4) == 4.0
    assert g.reducescatter_grad_factor(Average, 2.0, 0.5, 4) == 1.0
    assert g.reducescatter_grad_factor(Average, 3.0, 1.0, 4) == 3.0


def test_rows_of_a_scalar_is_one():
    assert g.rows_of(()) == 1
    assert g.rows_of((5, 2)) == 5
    assert g.rows_of((0,)) == 0


def test_the_bindings_export_the_core_basics():
    from hora.core import basics
    import hora.jax
    import hora.torch
    import hora.torch.mpi_ops
    for binding in (hora.torch, hora.jax):
        assert set(basics.__all__) <= set(binding.__all__), binding.__name__
        assert len(set(binding.__all__)) == len(binding.__all__), binding.__name__
    assert set(basics.JOB) <= set(dir(hora.torch.mpi_ops))
    # torch's own answers replace the core's two that depend on the framework
    assert hora.torch.nccl_built is hora.torch.mpi_ops.nccl_built is not basics.nccl_built
    assert hora.torch.cuda_built() is False
    assert hora.torch.size is basics.size is hora.jax.size
