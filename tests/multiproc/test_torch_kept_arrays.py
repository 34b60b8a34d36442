"""``hora.torch.allreduce_`` keeps the array of a small tensor it reduced, and gives it again
while the tensor has the same memory, shape and strides (``hora.torch.arrays.own_array``).
Real ranks change their tensors in place between calls (new storage, a new size, a transpose,
a dtype they cast to) and every result is checked against NumPy on every rank's inputs; the
kept arrays stay within their bounds, a large tensor is not kept, and a failing call of
``allreduce`` or ``allreduce_`` still tells the other ranks."""
import gc
import weakref

import numpy as np
import pytest

from tests.helpers import run_ranks

pytestmark = pytest.mark.timeout(60)
N = 2


def _inputs(r, step, shape, dtype="float32"):
    """Rank ``r``'s values at ``step``: small integers, exact in every dtype used here."""
    n = int(np.prod(shape))
    return ((np.arange(n) * (r + 2) + 3 * step + r) % 17).astype(dtype).reshape(shape)


def _job():
    import torch

    import hora.torch as hvd
    from hora.errors import CollectiveAbortedError
    from hora.torch import arrays
    torch.set_num_threads(1)
    r = hvd.rank()
    out = {}

    t = torch.from_numpy(_inputs(r, 0, (8,)))
    for step in range(4):                   # the same tensor, written anew each step
        t.copy_(torch.from_numpy(_inputs(r, step, (8,))))
        assert hvd.allreduce_(t, op=hvd.Sum, name="same") is t
        out["same", step] = t.numpy().copy()
    out["kept"] = id(t) in arrays._arrays

    old = t[:]                              # a view of the storage t is about to leave
    t.set_(torch.from_numpy(_inputs(r, 10, (8,))).clone())     # new storage, same shape
    hvd.allreduce_(t, op=hvd.Sum, name="same")
    out["set"] = (t.numpy().copy(), old.numpy().copy())

    t.resize_(5)                            # the same tensor, fewer elements
    t.copy_(torch.from_numpy(_inputs(r, 11, (5,))))
    hvd.allreduce_(t, op=hvd.Sum, name="resized")
    out["resized"] = t.numpy().copy()

    m = torch.from_numpy(_inputs(r, 12, (3, 3))).clone()
    hvd.allreduce_(m, op=hvd.Sum, name="m")
    out["m"] = m.numpy().copy()
    if r:                   # a transpose in place: the same memory and shape, other strides
        m.t_()
    m.copy_(torch.from_numpy(_inputs(r, 13, (3, 3))))
    hvd.allreduce_(m, op=hvd.Max, name="mt")
    out["mt"] = m.contiguous().numpy().copy()

    for i in range(3 * arrays._KEPT):      # many tensors, dropped after one call each
        x = torch.from_numpy(_inputs(r, 20 + i, (3,)))
        hvd.allreduce_(x, op=hvd.Sum, name=f"many.{i}")
        if i == 3 * arrays._KEPT - 1:
            out["many last"] = x.numpy().copy()
    out["count"] = len(arrays._arrays)

    big = torch.from_numpy(_inputs(r, 30, (arrays._KEPT_BYTES // 4 + 1,)))
    hvd.allreduce_(big, op=hvd.Sum, name="big")
    out["big"] = big.numpy().copy()
    gone = weakref.ref(big)
    del big
    gc.collect()
    out["big freed"] = gone() is None

    # a small view of a large tensor: kept, it would keep the large storage alive
    large = torch.from_numpy(_inputs(r, 31, (arrays._KEPT_BYTES // 4 + 1,)))
    for step in range(2):
        part = large[3:7]
        hvd.allreduce_(part, op=hvd.Sum, name="part")
    out["part"] = large[:10].numpy().copy()
    gone = weakref.ref(large)
    del large, part
    gc.collect()
    out["large freed"] = gone() is None

    # a failing call tells the other rank, whichever layer raised it
    bad = {"core": lambda: hvd.allreduce_(torch.ones(2), op=hvd.Sum,    # op and average
                                          average=True if r else None, name="bad.core"),
           "torch": lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64) if r
                                          else torch.ones(2), name="bad.torch")}
    for key, call in bad.items():
        try:
            call()
            out["bad", key] = None
        except CollectiveAbortedError as e:
            out["bad", key] = ("CollectiveAbortedError", str(e))
        except Exception as e:  # noqa: BLE001 - the failing rank's own error, by name
            out["bad", key] = (type(e).__name__, str(e))
    after = torch.full((3,), float(r + 1))
    hvd.allreduce_(after, op=hvd.Sum, name="after")
    out["after"] = after.numpy().copy()
    return out


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(_job, N, timeout_s=45)


def _sum(step, shape, dtype="float32"):
    return sum(_inputs(r, step, shape, dtype) for r in range(N))


def test_the_same_tensor_again(per_rank):
    for r, out in enumerate(per_rank):
        for step in range(4):
            np.testing.assert_array_equal(out["same", step], _sum(step, (8,)), f"rank {r}")
        assert out["kept"], f"rank {r}: the tensor's array was not kept"


def test_the_tensor_changed_in_place(per_rank):
    for r, out in enumerate(per_rank):
        got, old = out["set"]
        np.testing.assert_array_equal(got, _sum(10, (8,)), f"rank {r}: new storage")
        # the storage the tensor left keeps the last result it had
        np.testing.assert_array_equal(old, _sum(3, (8,)), f"rank {r}: old storage")
        np.testing.assert_array_equal(out["resized"], _sum(11, (5,)), f"rank {r}: resized")
        np.testing.assert_array_equal(out["m"], _sum(12, (3, 3)), f"rank {r}")
        expect = np.maximum(*(_inputs(k, 13, (3, 3)) for k in range(N)))
        np.testing.assert_array_equal(out["mt"], expect, f"rank {r}: transposed")


def test_the_kept_arrays_stay_within_bounds(per_rank):
    from hora.torch import arrays
    last = 3 * arrays._KEPT - 1
    for r, out in enumerate(per_rank):
        np.testing.assert_array_equal(out["many last"], _sum(20 + last, (3,)), f"rank {r}")
        assert out["count"] <= arrays._KEPT, out["count"]
        n = arrays._KEPT_BYTES // 4 + 1
        np.testing.assert_array_equal(out["big"], _sum(30, (n,)), f"rank {r}")
        assert out["big freed"], f"rank {r}: a tensor above _KEPT_BYTES was kept"
        part = _inputs(r, 31, (10,))
        part[3:7] = _sum(31, (10,))[3:7] * N       # reduced twice, in place
        np.testing.assert_array_equal(out["part"], part, f"rank {r}")
        assert out["large freed"], f"rank {r}: a view kept its large tensor alive"


def test_a_failing_call_tells_the_other_rank(per_rank):
    core, torch_ = per_rank[1]["bad", "core"], per_rank[1]["bad", "torch"]
    assert core is not None and core[0] == "ValueError", core
    assert torch_ is not None and torch_[0] == "TypeError" and "complex64" in torch_[1], torch_
    for key, own in (("core", core), ("torch", torch_)):
        told = per_rank[0]["bad", key]
        assert told is not None and told[0] == "CollectiveAbortedError", (key, told)
        assert "rank 1" in told[1] and own[0] in told[1], (key, told)
    for r, out in enumerate(per_rank):
        np.testing.assert_array_equal(out["after"], np.full(3, 3.0), f"rank {r}")
