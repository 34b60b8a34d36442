"""Sparse gradients on real ranks: ``hvd.sparse_allreduce_async`` (an allgather of indices
and values, as Horovod's) against NumPy on every rank's input and against the dense
allreduce, and ``DistributedOptimizer`` with ``nn.Embedding(sparse=True)`` against one
process training on the whole batch, gathering (``sparse_as_dense=False``) or reducing
densely (``sparse_as_dense=True``).

Every rank builds every rank's inputs from fixed seeds, so each can compute the oracle
locally.  One job runs every case and returns plain numbers.
"""
import traceback

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.helpers import run_ranks, section  # noqa: E402

NP = 3
SEED = 4321


# -- sparse_allreduce_async ------------------------------------------------------------------
# name: (shape, sparse_dim, dtype, ranks whose tensor has no entries, uncoalesced input)
CASES = {
    "rows": ((17, 5), 1, torch.float32, (), False),
    "elements": ((12, 7), 2, torch.float32, (), False),
    "rows_3d": ((9, 2, 3), 1, torch.float64, (), False),
    "one_rank_empty": ((8, 4), 1, torch.float32, (1,), False),
    "all_empty": ((8, 4), 1, torch.float32, (0, 1, 2), False),
    "duplicate_indices": ((10, 3), 1, torch.float64, (), True),
    "bfloat16": ((11, 4), 1, torch.bfloat16, (), False),
}


def _sparse_input(name, rank):
    """Rank ``rank``'s tensor of case ``name`` and its dense float64 value."""
    shape, sparse_dim, dtype, empty, duplicate = CASES[name]
    g = torch.Generator().manual_seed(SEED + 97 * rank + sum(map(ord, name)))
    dense = torch.randn(shape, generator=g, dtype=torch.float64)
    keep = torch.rand(shape[:sparse_dim], generator=g) < 0.3
    dense[~keep] = 0
    if rank in empty:
        dense.zero_()
    dense = dense.to(dtype).double()               # the values the rank really holds
    t = dense.to(dtype).to_sparse(sparse_dim)
    if duplicate and t._nnz():
        # the same entries twice, halved: an uncoalesced tensor with the same value
        idx, val = t.indices(), t.values() / 2
        t = torch.sparse_coo_tensor(torch.cat([idx, idx], 1), torch.cat([val, val]),
                                    t.shape, check_invariants=True)
    return t, dense


def _sparse_allreduce_section(hvd):
    rank, size = hvd.rank(), hvd.size()
    out = {}
    for i, name in enumerate(CASES):
        t, _ = _sparse_input(name, rank)
        op = hvd.Average if i % 2 == 0 else hvd.Sum
        handle = hvd.sparse_allreduce_async(t, name=f"sparse.{name}", op=op)
        # Horovod's way (call the handle) and hora's (synchronize), alternately
        result = handle() if i % 2 == 0 else hvd.synchronize(handle)
        expected = np.sum([_sparse_input(name, r)[1].numpy() for r in range(size)], axis=0)
        if op == hvd.Average:
            expected = expected / size
        dense_path = hvd.allreduce(t.to_dense(), name=f"dense.{name}", op=op)
        tol = 2e-2 if t.dtype == torch.bfloat16 else 1e-6
        out[name] = {
            "layout": (result.is_sparse, result.is_coalesced(), result.dtype == t.dtype,
                       tuple(result.shape) == tuple(t.shape)),
            "vs_numpy": float(np.abs(result.to_dense().double().numpy() - expected).max()),
            "vs_dense_path": float((result.to_dense().double()
                                    - dense_path.double()).abs().max()),
            "tol": tol,
            "values": result.to_dense().double().reshape(-1).tolist(),
        }
    # a process set of ranks 0 and 2: the average divides by its size
    evens = hvd.add_process_set([0, 2])
    if rank in (0, 2):
        t, _ = _sparse_input("rows", rank)
        result = hvd.sparse_allreduce_async(t, "evens", hvd.Average, process_set=evens)()
        expected = (_sparse_input("rows", 0)[1] + _sparse_input("rows", 2)[1]) / 2
        out["process_set"] = float((result.to_dense().double() - expected).abs().max())
    hvd.remove_process_set(evens)
    return out


# -- DistributedOptimizer with sparse embeddings ---------------------------------------------
VOCAB, DIM, BATCH, STEPS = 20, 4, 12, 3


class _EmbNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(SEED)
        self.emb = torch.nn.Embedding(VOCAB, DIM, sparse=True)
        self.fc = torch.nn.Linear(DIM, 3)

    def forward(self, idx, x, use_emb=True):
        return self.fc(self.emb(idx).mean(1) if use_emb else x)


def _shard(step, rank, size):
    g = torch.Generator().manual_seed(SEED + step)
    idx = torch.randint(0, VOCAB, (BATCH, 3), generator=g)
    x, y = torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, 3, generator=g)
    n = BATCH // size
    return idx[rank * n:(rank + 1) * n], x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _uses_emb(step, rank):
    # rank 1 skips the embedding in step 1: it has no gradient for it and contributes an
    # empty sparse one (after step 0 every rank knows the gradient is sparse)
    return not (step == 1 and rank == 1)


def _loss(model, step, rank, size):
    idx, x, y = _shard(step, rank, size)
    return torch.nn.functional.mse_loss(model(idx, x, _uses_emb(step, rank)), y)


OPT_CASES = {
    # name: (optimizer factories, DistributedOptimizer kwargs)
    "sgd_momentum_bucket": ("sgd", {}),
    "sgd_momentum_one_per_tensor": ("sgd", {"groups": 3}),
    "sgd_momentum_explicit_group": ("sgd", {"groups": "all"}),
    "adagrad": ("adagrad", {}),
    "sparse_adam_and_adam": ("sparse_adam", {}),
    "sgd_sparse_as_dense": ("sgd", {"sparse_as_dense": True}),
    "sparse_adam_sparse_as_dense": ("sparse_adam", {"sparse_as_dense": True}),
}


def _optimizers(kind, model):
    if kind == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)]
    if kind == "adagrad":
        return [torch.optim.Adagrad(model.parameters(), lr=0.1)]
    return [torch.optim.SparseAdam(list(model.emb.parameters()), lr=0.05),
            torch.optim.Adam(model.fc.parameters(), lr=0.05)]


def _optimizer_case(hvd, name):
    rank, size = hvd.rank(), hvd.size()
    kind, kwargs = OPT_CASES[name]
    model, ref = _EmbNet(), _EmbNet()
    opts = _optimizers(kind, model)
    kwargs = dict(kwargs)
    if kwargs.get("groups") == "all":
        kwargs["groups"] = [list(model.parameters())]
    opts = [hvd.DistributedOptimizer(o, named_parameters=[
        (n, p) for n, p in model.named_parameters()
        if any(p is q for g in o.param_groups for q in g["params"])], **kwargs) for o in opts]
    for o in opts:
        hvd.broadcast_optimizer_state(o, root_rank=0, model=model)
    ref_opts = _optimizers(kind, ref)
    out = {"layouts": [], "rows": [], "grad_diff": 0.0}
    for step in range(STEPS):
        # the oracle: one process, every rank's loss averaged (the average of the gradients)
        for o in ref_opts:
            o.zero_grad()
        (sum(_loss(ref, step, r, size) for r in range(size)) / size).backward()
        ref_grad = ref.emb.weight.grad.to_dense()
        for o in ref_opts:
            o.step()

        for o in opts:
            o.zero_grad()
        _loss(model, step, rank, size).backward()
        for o in opts:
            o.synchronize()
        grad = model.emb.weight.grad
        out["layouts"].append((grad.is_sparse, grad.sparse_dim()))
        out["grad_diff"] = max(out["grad_diff"],
                               float((grad.to_dense() - ref_grad).abs().max()))
        if not kwargs.get("sparse_as_dense"):
            # the rows any rank touched, as gathered (a dense reduction would drop none)
            touched = torch.cat([_shard(step, r, size)[0].reshape(-1) for r in range(size)
                                 if _uses_emb(step, r)]).unique()
            out["rows"].append(torch.equal(grad.coalesce().indices()[0], touched))
        for o in opts:
            with o.skip_synchronize():
                o.step()
    out["params"] = max(float((p - q).abs().max())
                        for p, q in zip(model.parameters(), ref.parameters()))
    out["flat"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    return out


def _sparse_job():
    import hora.torch as hvd
    torch.set_num_threads(1)
    out = {}

    def run(name, fn):
        try:
            out[name] = ("ok", fn())
        except Exception:                    # reported per section; the ranks keep in step
            out[name] = ("error", traceback.format_exc())
    run("sparse_allreduce", lambda: _sparse_allreduce_section(hvd))
    for name in OPT_CASES:
        run(name, lambda name=name: _optimizer_case(hvd, name))
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_sparse_job, NP, timeout_s=100)



@pytest.mark.timeout(120)
def test_sparse_allreduce_async_equals_numpy_and_the_dense_allreduce(results):
    per_rank = section(results, "sparse_allreduce")
    for rank, res in enumerate(per_rank):
        for name in CASES:
            r = res[name]
            assert r["layout"] == (True, True, True, True), f"{name}, rank {rank}: {r['layout']}"
            assert r["vs_numpy"] < r["tol"], f"{name}, rank {rank}: {r['vs_numpy']:.3g}"
            assert r["vs_dense_path"] < r["tol"], f"{name}, rank {rank}: {r['vs_dense_path']}"
            assert r["values"] == per_rank[0][name]["values"], f"{name}: rank {rank} differs"
    assert per_rank[0]["process_set"] < 1e-6 and per_rank[2]["process_set"] < 1e-6
    assert "process_set" not in per_rank[1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(OPT_CASES))
def test_sparse_embeddings_train_as_one_process_on_the_whole_batch(results, name):
    per_rank = section(results, name)
    for rank, res in enumerate(per_rank):
        # gathered or reduced densely, the gradient comes back sparse, in the embedding's
        # layout (row indices), with every touched row
        assert res["layouts"] == [(True, 1)] * STEPS, f"rank {rank}: {res['layouts']}"
        assert all(res["rows"]), f"rank {rank}: rows gathered {res['rows']}"
        assert res["grad_diff"] < 1e-6, f"rank {rank}: gradient {res['grad_diff']:.3g} off"
        assert res["params"] < 1e-6, f"rank {rank}: parameters {res['params']:.3g} off"
        assert res["flat"] == per_rank[0]["flat"], f"rank {rank} differs from rank 0"
