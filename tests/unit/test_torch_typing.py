"""``hora.torch``'s type hints reach users' type checkers: mypy reads the signatures of
the collectives, the handles and the optimizer wrapper from a Horovod-style script."""
import pytest

from tests.helpers import run_mypy

_USER_SCRIPT = """
    import torch
    import hora.torch as hvd

    hvd.init()
    model = torch.nn.Linear(3, 2)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.fp16)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0, model=model)
    reveal_type(hvd.allreduce(torch.ones(2), name="loss"))
    reveal_type(hvd.synchronize(hvd.allreduce_async(torch.ones(2))))
    reveal_type(hvd.sparse_allreduce_async(torch.ones(2).to_sparse(), "g", hvd.Sum)())
    reveal_type(hvd.grouped_allgather([torch.ones(2)]))
    reveal_type(hvd.join())
    with optimizer.skip_synchronize():
        optimizer.step()
    hvd.allreduce(torch.ones(2), name=3)
"""


@pytest.mark.timeout(180)
def test_mypy_reads_hora_torch_signatures(tmp_path, mypy_cache):
    revealed, out = run_mypy(_USER_SCRIPT, tmp_path, mypy_cache)
    assert revealed == ['"torch._tensor.Tensor"', '"Any"', '"torch._tensor.Tensor"',
                        '"list[torch._tensor.Tensor]"', '"int"'], out
    assert 'Argument "name" to "allreduce" has incompatible type "int"' in out, out
    assert "Found 1 error" in out, out
