"""TorchState.sync() and ElasticSampler's combined record on real ranks.

One job of 3 ranks; every rank starts from different weights, optimizer state, attributes and
sampler records, syncs, and reports plain lists.  The expectations are computed here from
rank 0's values and the shuffle rule, with plain Python.

Three ranks check all that two would and more, so there is no job of 2: with 3 the 7
indices left after the combined record split with padding (with 2 ranks, 14 split evenly),
rank 2 records more indices than its share holds, and the padded index that ranks 0 and 2
both processed must count once.  Both N pad the shares before the sync and record_batch's
rest, and TorchState.sync() broadcasts from rank 0 alike at any N.
"""
import math
import random

import pytest

torch = pytest.importorskip("torch")

from tests.helpers import job_fixture  # noqa: E402

N_DATA = 23
SEED = 3
BATCH = 3


def _plain(obj):
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def _worker(n):
    import hora.torch as hvd
    torch.set_num_threads(1)
    r = hvd.rank()
    torch.manual_seed(100 + r)                                 # different weights per rank
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
    for _ in range(r + 1):                                     # and different Adam state
        optimizer.zero_grad()
        model(torch.randn(4, 3)).pow(2).sum().backward()
        optimizer.step()
    by_indices = hvd.elastic.ElasticSampler(range(N_DATA), seed=SEED)
    by_batch = hvd.elastic.ElasticSampler(range(N_DATA), seed=SEED)
    state = hvd.elastic.TorchState(model, optimizer, by_indices=by_indices, by_batch=by_batch,
                                   epoch=10 + r, info={"rank": r})
    state.commit()
    before = dict(model=_plain(model.state_dict()), optimizer=_plain(optimizer.state_dict()),
                  share=list(by_indices))
    # every rank processes a different number of its own batches: rank r does r + 1 of them
    done = [i for b in range(r + 1) for i in by_indices.get_indices(b, BATCH)]
    by_indices.record_indices(done)
    for b in range(2):                                         # lockstep: the same count
        by_batch.record_batch(b, BATCH)
    state.epoch = 99                                           # not committed: sync ignores
    state.sync()
    return dict(before=before, done=done,
                model=_plain(model.state_dict()), optimizer=_plain(optimizer.state_dict()),
                epoch=state.epoch, info=state.info,
                by_indices=list(by_indices), by_indices_len=len(by_indices),
                by_batch=list(by_batch), processed_num=by_batch.processed_num)


job = job_fixture(_worker, timeout_s=60)


@pytest.mark.parametrize("n", [3])
def test_sync_gives_every_rank_rank0s_model_optimizer_and_attributes(job, n):
    results = job(n)
    root = results[0]["before"]
    assert results[1]["before"]["model"] != root["model"]      # they did differ
    for res in results:
        assert res["model"] == root["model"]
        assert res["optimizer"] == root["optimizer"]
        assert (res["epoch"], res["info"]) == (10, {"rank": 0})


@pytest.mark.parametrize("n", [3])
def test_sampler_sync_combines_every_ranks_processed_indices(job, n):
    results = job(n)
    order = list(range(N_DATA))
    random.Random(SEED).shuffle(order)
    # the shares before: Horovod's padding and rank::n split, computed here
    per_rank = math.ceil(N_DATA / n)
    padded = order + order[:per_rank * n - N_DATA]
    for r, res in enumerate(results):
        assert res["before"]["share"] == padded[r::n]
        assert res["done"] == padded[r::n][:BATCH * (r + 1)]
    processed = {i for res in results for i in res["done"]}
    remaining = [i for i in order if i not in processed]
    handed = [i for res in results for i in res["by_indices"]]
    assert not processed & set(handed)                         # nobody's work is done again
    assert set(handed) == set(remaining)                       # and nothing is left out
    per_rank = math.ceil(len(remaining) / n)
    padded = remaining + remaining[:per_rank * n - len(remaining)]
    for r, res in enumerate(results):
        assert res["by_indices"] == padded[r::n]
        assert res["by_indices_len"] == per_rank
    # record_batch: rank 0's count (2 batches on n ranks), the processed prefix skipped
    rest = order[2 * BATCH * n:]
    per_rank = math.ceil(len(rest) / n)
    padded = rest + rest[:per_rank * n - len(rest)]
    for r, res in enumerate(results):
        assert res["processed_num"] == 2 * BATCH * n
        assert res["by_batch"] == padded[r::n]
