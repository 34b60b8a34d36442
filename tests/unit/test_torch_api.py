"""``hora.torch`` in one process (a job of size 1): the ops as identities, gradcheck, typed
errors at the edge, compression and the state helpers."""
import pytest
import torch

import hora.torch as hvd

pytestmark = pytest.mark.timeout(60)

# Horovod's names and signatures: tests/unit/test_torch_horovod_names.py
BUILT = ["mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
         "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built"]


def test_built_queries_answer_false():
    assert all(getattr(hvd, name)() is False for name in BUILT)


@pytest.fixture
def alone():
    hvd.init()
    torch.set_num_threads(1)
    yield
    hvd.shutdown()


def test_ops_are_identities_at_size_one(alone):
    for dtype in (torch.float32, torch.bfloat16, torch.int16, torch.bool):
        x = (torch.arange(6).reshape(2, 3) % 2).to(dtype)
        op = hvd.Max if dtype == torch.bool else None
        for y in (hvd.allreduce(x, op=op), hvd.allgather(x), hvd.broadcast(x, 0),
                  hvd.alltoall(x), hvd.reducescatter(x, op=op or hvd.Average)):
            assert y.dtype == dtype and torch.equal(y, x) and y.data_ptr() != x.data_ptr()
        assert hvd.allreduce_(x, op=op) is x and hvd.broadcast_(x, 0) is x
    x = torch.arange(6.0).reshape(2, 3).t()                 # non-contiguous, in place
    assert torch.equal(hvd.allreduce_(x, op=hvd.Sum, postscale_factor=2.0),
                       2 * torch.arange(6.0).reshape(2, 3).t())
    out, splits = hvd.alltoall(torch.arange(3.0), splits=[3])
    assert torch.equal(out, torch.arange(3.0)) and splits.tolist() == [3]
    assert splits.dtype == torch.int32
    h = hvd.allreduce_async(torch.ones(2), name="h")
    assert isinstance(hvd.poll(h), bool) and torch.equal(hvd.synchronize(h), torch.ones(2))
    assert hvd.join() == 0
    hvd.barrier()


def test_gradcheck_at_size_one(alone):
    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    ops = [lambda t: hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0),
           lambda t: hvd.allreduce(t, average=True), hvd.allgather,
           lambda t: hvd.broadcast(t, 0), hvd.alltoall, lambda t: hvd.alltoall(t, [3])[0],
           lambda t: hvd.reducescatter(t, op=hvd.Sum, prescale_factor=2.0),
           lambda t: torch.cat(hvd.grouped_allreduce([t, 2 * t], op=hvd.Average))]
    for op in ops:
        assert torch.autograd.gradcheck(op, (x,))


def test_bad_input_is_a_typed_error(alone):
    with pytest.raises(TypeError, match="complex64"):
        hvd.allreduce(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="bool"):
        hvd.allreduce(torch.ones(2, dtype=torch.bool))                 # Average
    with pytest.raises(TypeError, match="bool"):
        hvd.reducescatter(torch.ones(2, dtype=torch.bool))
    for call in (hvd.allreduce, hvd.allreduce_, hvd.grouped_allgather, hvd.alltoall,
                 hvd.reducescatter, lambda t: hvd.broadcast(t, 0)):
        with pytest.raises(TypeError, match="Tensor"):
            call([1.0, 2.0] if call is not hvd.grouped_allgather else [[1.0, 2.0]])
    with pytest.raises(ValueError):
        hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum)
    with pytest.raises(ValueError, match="splits"):
        hvd.alltoall(torch.ones(2), splits=[3])


def test_non_tensor_input_is_a_type_error_everywhere(alone):
    with pytest.raises(TypeError, match="Tensor"):
        hvd.allgather([1.0, 2.0])
    with pytest.raises(TypeError, match="Tensor"):
        hvd.allreduce([1.0, 2.0], compression=hvd.Compression.fp16)


def test_compression():
    x = torch.linspace(-1, 1, 7, dtype=torch.float64)
    sent, ctx = hvd.Compression.fp16.compress(x)
    assert sent.dtype == torch.float16
    back = hvd.Compression.fp16.decompress(sent, ctx)
    assert back.dtype == torch.float64 and torch.allclose(back, x, atol=1e-3)
    i = torch.arange(3)
    assert hvd.Compression.fp16.decompress(*hvd.Compression.fp16.compress(i)) is i
    assert hvd.Compression.none.decompress(*hvd.Compression.none.compress(x)) is x


def test_state_helpers_and_process_sets_at_size_one(alone):
    model = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_parameters(model.named_parameters(), root_rank=0)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert hvd.broadcast_object({"a": [1]}, root_rank=0) == {"a": [1]}
    assert hvd.allgather_object(("x", 1)) == [("x", 1)]
    ps = hvd.add_process_set([0])
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=ps), torch.ones(2))
    hvd.remove_process_set(ps)


def test_the_first_bucket_is_small_only_when_a_cpu_is_free_for_communication(alone,
                                                                           monkeypatch):
    from hora.torch import buckets
    cpu = [torch.nn.Parameter(torch.zeros(3))]
    monkeypatch.setattr(buckets, "usable_cpus", lambda: 4)
    monkeypatch.setattr(buckets.torch, "get_num_threads", lambda: 3)
    assert buckets.spare_cpu(cpu)               # 1 rank x 3 threads on 4 CPUs
    monkeypatch.setattr(buckets.torch, "get_num_threads", lambda: 4)
    assert not buckets.spare_cpu(cpu)           # backward keeps every CPU busy
    # a model on an accelerator computes elsewhere (the meta device stands in for one)
    assert buckets.spare_cpu([torch.nn.Parameter(torch.zeros(3, device="meta"))])


def test_buckets_follow_backward_order_with_a_small_first_one():
    from hora.torch.buckets import param_buckets as _buckets
    params = [torch.zeros(n) for n in (10, 20, 30, 40, 50)]       # float32: 4 bytes each
    sizes = lambda chunks: [[p.numel() for p in c] for c in chunks]  # noqa: E731
    # reverse order; the first bucket holds at most 200 bytes, the others 360
    assert sizes(_buckets(params, 360, 200)) == [[50], [40, 30, 20], [10]]
    assert sizes(_buckets(params, 400)) == [[50, 40], [30, 20, 10]]
    assert sizes(_buckets(params, 400, 1 << 20)) == sizes(_buckets(params, 400))
    assert sizes(_buckets(params, 0, 200)) == [[10], [20], [30], [40], [50]]
    # a tensor larger than its bucket's cap gets a bucket of its own
    assert sizes(_buckets(params, 100, 40)) == [[50], [40], [30], [20], [10]]
