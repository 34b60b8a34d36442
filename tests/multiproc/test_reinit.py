"""A second init() in the same process starts as the first did (Horovod users re-init in tests
and notebooks): automatic names count from 0 again, the last job's process sets are
forgotten (and can be added again), global_process_set stays the object users imported, and
the results are right, checked against numpy."""
import numpy as np
import pytest

import hora
from tests.helpers import run_ranks

SIZE = 2


def _inputs(rank):
    return np.arange(6, dtype=np.float64).reshape(3, 2) + 10 * rank


def _one_job(kept, imported_global):
    """Everything a job does, the same in both jobs; ``kept``: a ProcessSet made once, before
    the first init(), added in each job."""
    rank = hora.rank()
    x = _inputs(rank)
    out = {"ids_at_start": [ps.process_set_id for ps in kept]}
    handles = {
        "sum": hora.allreduce_async(x, op=hora.Sum),
        "average": hora.allreduce_async(x),
        "grouped": hora.grouped_allreduce_async([x, x[0]], op=hora.Sum),
        "gather": hora.allgather_async(x[:rank + 1]),
        "bcast": hora.broadcast_async(x, root_rank=1),
        "a2a": hora.alltoall_async(np.arange(4) + 100 * rank),
        "rs": hora.reducescatter_async(x, op=hora.Sum),
        "barrier": hora.barrier_async(),
    }
    out["names"] = {k: h.name for k, h in handles.items()}
    out["results"] = {k: hora.synchronize(h) for k, h in handles.items()}
    out["objects"] = (hora.allgather_object(("r", rank)), hora.broadcast_object(rank, 1))
    hora.add_process_set(kept[0])
    added = hora.add_process_set([1])           # a new object in each job
    out["ids"] = [kept[0].process_set_id, added.process_set_id]
    mine = kept[0] if rank == 0 else added
    out["in_set"] = hora.allreduce(x, op=hora.Sum, process_set=mine)
    out["global"] = (hora.global_process_set is imported_global,
                     hora.global_process_set.process_set_id, hora.global_process_set.ranks)
    out["in_global"] = hora.allreduce(x, op=hora.Sum, process_set=hora.global_process_set)
    # one more unnamed collective than the names above show: without a restart at init(),
    # the next job's automatic names would be shifted by it
    hora.allreduce(x)
    return out


def _two_jobs():
    imported_global = hora.global_process_set
    kept = [hora.ProcessSet([0])]
    jobs = []
    for _ in range(2):
        hora.init()
        try:
            jobs.append(_one_job(kept, imported_global))
        finally:
            hora.shutdown()
        jobs[-1]["ids_after_shutdown"] = [ps.process_set_id for ps in kept]
    return jobs


@pytest.mark.timeout(60)
def test_second_init_starts_as_the_first():
    results = run_ranks(_two_jobs, SIZE, timeout_s=40, init=False)
    inputs = [_inputs(r) for r in range(SIZE)]
    total = sum(inputs)
    for rank, (first, second) in enumerate(results):
        for job in (first, second):
            res = job["results"]
            np.testing.assert_array_equal(res["sum"], total)
            np.testing.assert_allclose(res["average"], total / SIZE)
            np.testing.assert_array_equal(res["grouped"][0], total)
            np.testing.assert_array_equal(res["grouped"][1], total[0])
            np.testing.assert_array_equal(
                res["gather"], np.concatenate([inputs[r][:r + 1] for r in range(SIZE)]))
            np.testing.assert_array_equal(res["bcast"], inputs[1])
            received, splits = res["a2a"]
            np.testing.assert_array_equal(
                received, np.concatenate([(np.arange(4) + 100 * r)[2 * rank:2 * rank + 2]
                                          for r in range(SIZE)]))
            assert splits.tolist() == [2, 2]
            np.testing.assert_array_equal(res["rs"], total[[0, 1]] if rank == 0 else total[[2]])
            assert job["objects"] == ([("r", r) for r in range(SIZE)], 1)
            np.testing.assert_array_equal(job["in_set"], inputs[rank])
            assert job["global"] == (True, 0, list(range(SIZE)))
            np.testing.assert_array_equal(job["in_global"], total)
            # the last job's sets are forgotten at init(), not at shutdown() (as Horovod)
            assert job["ids_at_start"] == [None]
            assert job["ids_after_shutdown"] == job["ids"][:1]
        assert first["names"]["sum"] == "allreduce.noname.0"
        assert first["names"]["gather"] == "allgather.noname.0"
        assert first["names"]["barrier"] == "barrier.noname.0"
        assert second["names"] == first["names"]
        assert second["ids"] == first["ids"]
        assert first["ids"] == [1, 2]
