"""Process sets and join() across real processes, checked against numpy."""
import numpy as np
import pytest

import hora
from tests.helpers import run_ranks


def _sets():
    rank, size = hora.rank(), hora.size()
    even = hora.add_process_set([r for r in range(size) if r % 2 == 0])
    odd = hora.add_process_set(hora.ProcessSet([r for r in range(size) if r % 2]))
    mine = even if rank % 2 == 0 else odd
    out = {"ids": (even.process_set_id, odd.process_set_id), "set_rank": mine.rank(),
           "set_size": mine.size()}
    x = np.arange(5, dtype=np.float64) + rank
    # the same name in both sets, submitted while the global set also uses it
    h_set = hora.allreduce_async(x, op=hora.Sum, name="x", process_set=mine)
    h_all = hora.allreduce_async(x, op=hora.Sum, name="x")
    out["set_sum"], out["all_sum"] = hora.synchronize(h_set), hora.synchronize(h_all)
    out["gather"] = hora.allgather(np.array([rank]), process_set=mine)
    root = mine.ranks[-1]
    out["bcast"] = hora.broadcast(np.array([rank * 10]), root_rank=root, process_set=mine)
    out["a2a"] = hora.alltoall(np.arange(mine.size()) + 100 * rank, process_set=mine)
    out["rs"] = hora.reducescatter(np.ones((mine.size() + 1, 2)), op=hora.Sum, process_set=mine)
    out["obj"] = hora.allgather_object(("r", rank), process_set=mine)
    hora.barrier(process_set=mine)
    try:
        hora.allreduce(x, process_set=odd if mine is even else even, name="wrong")
    except hora.HoraError as e:
        out["not_member"] = str(e)
    hora.remove_process_set(even)
    hora.remove_process_set(odd)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("np_", [3, 4])
def test_collectives_over_process_sets(np_):
    results = run_ranks(_sets, np_, timeout_s=40)
    inputs = [np.arange(5, dtype=np.float64) + r for r in range(np_)]
    for rank, out in enumerate(results):
        members = [r for r in range(np_) if r % 2 == rank % 2]
        assert out["ids"] == (1, 2)
        assert (out["set_rank"], out["set_size"]) == (members.index(rank), len(members))
        np.testing.assert_array_equal(out["set_sum"], sum(inputs[r] for r in members))
        np.testing.assert_array_equal(out["all_sum"], sum(inputs))
        np.testing.assert_array_equal(out["gather"], members)
        np.testing.assert_array_equal(out["bcast"], [members[-1] * 10])
        received, splits = out["a2a"]
        me = members.index(rank)
        np.testing.assert_array_equal(received, [100 * r + me for r in members])
        assert splits.tolist() == [1] * len(members)
        rows = len(members) + 1
        mine = rows // len(members) + (1 if me < rows % len(members) else 0)
        np.testing.assert_array_equal(out["rs"], np.full((mine, 2), float(len(members))))
        assert out["obj"] == [("r", r) for r in members]
        assert f"rank {rank} is not a member" in out["not_member"]


def _static_sets():
    # Horovod's style: sets passed to init()
    even = hora.ProcessSet([0, 2])
    hora.init(process_sets=[even])
    try:
        if hora.rank() in (0, 2):
            return hora.allreduce(np.array([hora.rank()]), op=hora.Sum, process_set=even)
        return None
    finally:
        hora.shutdown()


@pytest.mark.timeout(60)
def test_process_sets_given_to_init():
    results = run_ranks(_static_sets, 3, timeout_s=30, init=False)
    assert results[1] is None
    for r in (0, 2):
        np.testing.assert_array_equal(results[r], [2])


def _uneven(batches_by_rank):
    rank = hora.rank()
    seen = []
    for step in range(batches_by_rank[rank]):
        x = np.full(4, float(rank + 1 + step))
        seen.append(hora.allreduce(x, op=hora.Average, name="grad"))
        seen.append(hora.allreduce(np.array([rank + step], np.int64), op=hora.Sum, name="n"))
    last = hora.join()
    after = hora.allreduce(np.ones(2), op=hora.Sum, name="after")
    return seen, last, after


@pytest.mark.timeout(60)
def test_join_lets_ranks_with_less_data_contribute_zeros():
    batches = [3, 1, 2]
    results = run_ranks(_uneven, 3, timeout_s=30, args=(batches,))
    size = len(batches)
    for rank, (seen, last, after) in enumerate(results):
        assert last == 0                          # rank 0 has the most batches: joins last
        np.testing.assert_array_equal(after, [3.0, 3.0])
        for step in range(batches[rank]):
            active = [r for r in range(size) if batches[r] > step]
            # joined ranks add zeros; Average still divides by the job size (Horovod's rule)
            np.testing.assert_allclose(seen[2 * step],
                                       np.full(4, sum(r + 1 + step for r in active) / size))
            assert seen[2 * step + 1].tolist() == [sum(r + step for r in active)]
