"""hora.core.fusion: packing, unpacking and scaling, with NumPy arrays and with torch tensors
(the ops a device plane brings), checked against plain NumPy on the inputs."""
import numpy as np
import pytest

from hora.core.fusion import NUMPY, Fusion, plan_buckets, scale, split_even


def _arrays(rng):
    return [rng.standard_normal((3, 4)).astype(np.float32),
            rng.standard_normal(5).astype(np.float32),
            np.float32(rng.standard_normal((2, 3)))[:, ::2],      # not contiguous
            np.zeros((0, 7), np.float32)]


@pytest.mark.parametrize("inplace", [False, True])
def test_pack_then_unpack_gives_the_arrays_back(inplace):
    rng = np.random.default_rng(0)
    arrays = _arrays(rng)
    before = [a.copy() for a in arrays]
    fusion = Fusion(NUMPY)
    buf = fusion.pack(arrays, np.dtype(np.float32), inplace)
    assert buf.ndim == 1 and buf.flags.c_contiguous
    np.testing.assert_array_equal(buf, np.concatenate([a.reshape(-1) for a in before]))
    buf *= 2                                       # what a reduction would do
    outs = fusion.unpack(buf, arrays, inplace)
    for a, b, out in zip(arrays, before, outs):
        assert out.shape == b.shape
        np.testing.assert_array_equal(out, 2 * b)
        if inplace:
            assert out is a
        else:
            np.testing.assert_array_equal(a, b)    # the callers' arrays are untouched


def test_a_lone_contiguous_array_reduced_in_place_is_its_own_buffer():
    a = np.arange(6, dtype=np.float64).reshape(2, 3)
    fusion = Fusion(NUMPY)
    buf = fusion.pack([a], np.dtype(np.float64), True)
    assert np.shares_memory(buf, a)
    assert not np.shares_memory(fusion.pack([a], np.dtype(np.float64), False), a)
    strided = np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2]
    copy = fusion.pack([strided], np.dtype(np.float64), True)
    assert not np.shares_memory(copy, strided)
    copy[:] = -1
    assert fusion.unpack(copy, [strided], True)[0] is strided
    assert (strided == -1).all()


def test_the_reusable_buffer_is_kept_per_dtype_and_grown():
    fusion = Fusion(NUMPY)
    small = fusion.pack([np.ones(2, np.float32), np.ones(3, np.float32)], np.dtype(np.float32),
                        True)
    again = fusion.pack([np.ones(1, np.float32), np.ones(1, np.float32)], np.dtype(np.float32),
                        True)
    assert np.shares_memory(small, again)
    other = fusion.pack([np.ones(2, np.int32), np.ones(2, np.int32)], np.dtype(np.int32), True)
    assert not np.shares_memory(other, small)
    bigger = fusion.pack([np.ones(50, np.float32), np.ones(50, np.float32)],
                         np.dtype(np.float32), True)
    assert bigger.size == 100 and not np.shares_memory(bigger, small)
    fresh = fusion.pack([np.ones(2, np.float32), np.ones(2, np.float32)], np.dtype(np.float32),
                        False)
    assert not np.shares_memory(fresh, bigger)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.int64])
def test_scale_rounds_as_one_double_factor(dtype):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(1000) * 100).astype(dtype)
    factor, divisor = 0.3, 3
    by = 0.3 / 3
    if dtype == np.float16:
        want = (x.astype(np.float32) * np.float32(by)).astype(np.float16)
    elif dtype == np.float32:
        want = x * np.float32(by)
    elif dtype == np.float64:
        want = x * by
    else:
        want = np.trunc(x.astype(np.float64) * by).astype(dtype)
    got = x.copy()
    scale(got, factor, divisor)
    np.testing.assert_array_equal(got, want)
    same = x.copy()
    scale(same, 2.0, 2)
    np.testing.assert_array_equal(same, x)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.complex64,
                                   np.int32])
def test_scale_of_one_element_rounds_as_of_many(dtype):
    """A one-element buffer is scaled by a path of its own (numpy's in-place multiply is
    slow there): each element comes out as it does in a longer buffer."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(200) * 100).astype(dtype)
    many = x.copy()
    scale(many, 0.7, 3)
    for i in range(x.size):
        one = x[i:i + 1].copy()
        scale(one, 0.7, 3)
        assert one.dtype == dtype and one.tobytes() == many[i:i + 1].tobytes()


def test_torch_tensors_through_the_device_planes_ops():
    torch = pytest.importorskip("torch")
    from hora.backends.nccl import TorchOps
    fusion = Fusion(TorchOps(torch))
    tensors = [torch.arange(6, dtype=torch.float32).view(2, 3),
               torch.arange(8, dtype=torch.float32).view(4, 2).t(),         # not contiguous
               torch.ones(3)]
    want = [2 * t.clone() for t in tensors]
    buf = fusion.pack(tensors, torch.float32, True)
    buf.mul_(2)
    outs = fusion.unpack(buf, tensors, True)
    for t, w, out in zip(tensors, want, outs):
        assert out is t
        assert torch.equal(t, w)
    lone = torch.arange(4, dtype=torch.float32)
    assert fusion.pack([lone], torch.float32, True).data_ptr() == lone.data_ptr()
    ints = torch.tensor([7, -7, 5], dtype=torch.int32)
    fusion.ops.scale(ints, 1.0, 2)
    assert ints.tolist() == [3, -3, 2]


def test_plan_buckets_packs_in_reverse_order():
    sizes = [10, 20, 30, 40, 50]
    assert plan_buckets(sizes, 100) == [[4, 3], [2, 1, 0]]
    assert plan_buckets(sizes, 100, 45) == [[4], [3, 2, 1, 0]]     # 50 > 45: alone
    assert plan_buckets(sizes, 90, 45) == [[4], [3, 2, 1], [0]]
    assert plan_buckets(sizes, 0) == [[0], [1], [2], [3], [4]]
    assert plan_buckets([], 100) == [[]]
    assert plan_buckets([500], 100) == [[0]]        # a tensor larger than the cap: alone


def test_split_even():
    assert split_even(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_even([1, 2], 4) == [[1], [2]]
    assert split_even([], 2) == []
