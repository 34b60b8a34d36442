"""Elastic states (hora.elastic.State/ObjectState, hvd.elastic.TorchState) and ElasticSampler
in one process (size 1).  Expectations are computed here with plain Python and copies taken
by the test, never by the code under test."""
import copy
import math
import random

import pytest

torch = pytest.importorskip("torch")

import hora.torch as hvd  # noqa: E402
from hora.elastic import ObjectState, State  # noqa: E402
from hora.errors import HostsUpdatedInterrupt, HoraError  # noqa: E402
from hora.torch.elastic import ElasticSampler, TorchState, _shard  # noqa: E402


@pytest.fixture
def alone():
    hvd.init()
    torch.set_num_threads(1)
    yield
    hvd.shutdown()


def _order(n, seed, epoch, shuffle=True):
    order = list(range(n))
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    return order


# -- State / ObjectState -----------------------------------------------------------------------
def test_state_is_abstract_and_commit_saves_then_checks_hosts():
    calls = []

    class Recording(State):
        def save(self):
            calls.append("save")

        def check_host_updates(self):
            calls.append("check")

    Recording(lambda obj: obj, lambda: 0).commit()
    assert calls == ["save", "check"]
    bare = State(lambda obj: obj, lambda: 0)
    for method in (bare.save, bare.restore, bare.sync):
        with pytest.raises(NotImplementedError):
            method()
    bare.on_hosts_updated(1.0, 2)
    assert bare.check_host_updates() is None         # no launcher reports host changes yet


def test_reset_callbacks_run_after_reset_in_order():
    calls = []

    class Tracked(ObjectState):
        def reset(self):
            calls.append("reset")

    state = Tracked(lambda obj: obj, lambda: 0, epoch=0)
    state.register_reset_callbacks([lambda: calls.append("a")])
    state.register_reset_callbacks([lambda: calls.append("b"), lambda: calls.append("c")])
    state.on_reset()
    assert calls == ["reset", "a", "b", "c"]


def test_object_state_commit_restore_with_deep_copies():
    state = ObjectState(lambda obj: obj, lambda: 0, epoch=0, seen=[1, 2])
    assert (state.epoch, state.seen) == (0, [1, 2])
    state.epoch = 3
    state.seen.append(3)
    state.restore()                                   # back to the constructor's values
    assert (state.epoch, state.seen) == (0, [1, 2])
    state.epoch = 4
    state.seen.append(4)
    state.commit()
    state.seen.append(5)                              # in place, after the commit
    state.epoch = 9
    state.restore()
    assert (state.epoch, state.seen) == (4, [1, 2, 4])
    state.seen.append(6)                              # in place, after the restore
    state.restore()
    assert state.seen == [1, 2, 4]


def test_object_state_sync_takes_the_broadcast_commit(alone):
    state = ObjectState(hvd.broadcast_object, hvd.rank, epoch=1, name="a")
    state.epoch = 7                                   # not committed: sync sends the commit
    state.sync()
    assert (state.epoch, state.name) == (1, "a")
    replaced = ObjectState(lambda obj: {k: v * 2 for k, v in obj.items()}, lambda: 1, x=5)
    replaced.sync()
    assert replaced.x == 10


def test_hosts_updated_interrupt_is_horovods():
    err = HostsUpdatedInterrupt(True)
    assert err.skip_sync is True
    assert isinstance(err, HoraError) and isinstance(err, RuntimeError)
    assert HostsUpdatedInterrupt().skip_sync is False


# -- TorchState --------------------------------------------------------------------------------
def _train(model, optimizer, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _equal_state_dicts(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal_state_dicts(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal_state_dicts(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.Adam(p, lr=0.01),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)])
def test_torch_state_restore_gives_the_committed_weights_and_optimizer_state(alone, make_opt):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    optimizer = make_opt(model.parameters())
    state = TorchState(model, optimizer, epoch=0)
    assert state.model is model and state.optimizer is optimizer
    _train(model, optimizer, 2, seed=1)
    state.epoch = 2
    state.commit()
    weights = copy.deepcopy(model.state_dict())
    opt_state = copy.deepcopy(optimizer.state_dict())
    for round_ in range(2):                           # restore twice: the commit stays intact
        _train(model, optimizer, 3, seed=2 + round_)
        state.epoch = 5
        assert not _equal_state_dicts(model.state_dict(), weights)
        assert not _equal_state_dicts(optimizer.state_dict(), opt_state)
        state.restore()
        assert _equal_state_dicts(model.state_dict(), weights)
        assert _equal_state_dicts(optimizer.state_dict(), opt_state)
        assert state.epoch == 2
    state.sync()                                      # size 1: nothing changes
    assert _equal_state_dicts(model.state_dict(), weights)
    assert _equal_state_dicts(optimizer.state_dict(), opt_state)


def test_torch_state_assigning_a_new_model_commits_it(alone):
    old, new = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    state = TorchState(model=old, other=torch.nn.Linear(1, 1))
    state.model = new
    expected = copy.deepcopy(new.state_dict())
    with torch.no_grad():
        new.weight.add_(1.0)
    state.restore()
    assert state.model is new and _equal_state_dicts(new.state_dict(), expected)
    assert state.optimizer is None and isinstance(state.other, torch.nn.Linear)


# -- ElasticSampler ----------------------------------------------------------------------------
def test_sampler_hands_out_every_index_once_per_epoch(alone):
    for shuffle in (True, False):
        sampler = ElasticSampler(list(range(17)), shuffle=shuffle, seed=5)
        assert len(sampler) == 17
        assert list(sampler) == _order(17, 5, 0, shuffle)
        assert sorted(sampler) == list(range(17))


def test_set_epoch_reshuffles_by_seed_plus_epoch(alone):
    a = ElasticSampler(range(40), seed=3)
    b = ElasticSampler(range(40), seed=3)
    first = list(a)
    a.set_epoch(1)
    b.set_epoch(1)
    assert list(a) == list(b) == _order(40, 3, 1)
    assert list(a) != first
    c = ElasticSampler(range(40), seed=4)            # seed 4, epoch 0 == seed 3, epoch 1
    assert list(c) == list(a)


def test_record_batch_skips_the_processed_prefix_and_set_epoch_clears_it(alone):
    sampler = ElasticSampler(range(23), seed=1)
    order = list(sampler)
    for batch_idx in range(3):
        sampler.record_batch(batch_idx, 4)
    assert sampler.processed_num == 12
    sampler.reset()
    assert list(sampler) == order[12:] and len(sampler) == 11
    restored = ElasticSampler(range(23), seed=1)
    restored.load_state_dict({"epoch": 0, "processed_num": 12})   # Horovod's state_dict
    assert list(restored) == order[12:]
    sampler.set_epoch(1)
    assert list(sampler) == _order(23, 1, 1)


def test_record_indices_with_get_indices(alone):
    sampler = ElasticSampler(range(10), seed=2)
    order = list(sampler)
    assert sampler.get_indices(0, 4) == order[:4]
    assert sampler.get_indices(2, 4) == order[8:]     # the last batch is short
    sampler.record_indices(sampler.get_indices(1, 4))
    sampler.record_indices([order[9]])
    saved = sampler.state_dict()
    sampler.reset()
    expected = [i for i in order if i not in set(order[4:8]) | {order[9]}]
    assert list(sampler) == expected
    sampler.record_indices(expected)
    sampler.load_state_dict(saved)                    # back to the saved record
    assert list(sampler) == expected


def test_reset_partitions_the_remaining_indices_over_any_size(alone):
    sampler = ElasticSampler(range(29), seed=7)
    order = list(sampler)
    sampler.record_batch(0, 5)
    sampler.record_indices([order[20], order[27]])
    sampler.reset()
    processed = set(order[:5]) | {order[20], order[27]}
    remaining = [i for i in order if i not in processed]
    assert sampler.remaining_indices == remaining
    for n in range(1, 8):
        shares = [_shard(remaining, n, r) for r in range(n)]
        per_rank = math.ceil(len(remaining) / n)
        assert all(len(s) == per_rank for s in shares)
        handed = [i for s in shares for i in s]
        assert not processed & set(handed)
        assert sorted(set(handed)) == sorted(remaining)
        # each remaining index once, plus Horovod's padding: the first ones, once more
        pad = per_rank * n - len(remaining)
        assert sorted(handed) == sorted(remaining + remaining[:pad])
        # this rank's share is every n-th, starting at its rank
        for r in range(n):
            assert shares[r] == (remaining + remaining[:pad])[r::n]
    assert _shard([4], 3, 2) == [4]                  # padding longer than what is left
    assert _shard([], 3, 0) == []


def test_torch_state_commits_and_restores_a_sampler(alone):
    sampler = ElasticSampler(range(12), seed=0)
    order = list(sampler)
    state = TorchState(sampler=sampler, epoch=0)
    sampler.record_batch(0, 3)
    state.commit()
    sampler.record_batch(1, 3)
    sampler.record_indices([order[11]])
    state.restore()
    assert sampler.processed_num == 3 and sampler.processed_indices == set()
    assert list(sampler) == order[3:]
    state.sync()                                      # size 1: union of one rank's record
    assert list(sampler) == order[3:]
