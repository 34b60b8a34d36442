"""Automatic names are counted per process set: unnamed collectives on a set that some
ranks are not in must not shift the names of the global set's later unnamed collectives
(which would stall the job), checked across real processes against numpy."""
import numpy as np
import pytest

import hora
from tests.helpers import run_ranks

SIZE = 3
MEMBERS = [0, 1]


def _inputs(rank):
    return np.arange(4, dtype=np.float64) + 10 * rank


def _unnamed_after_set():
    rank = hora.rank()
    x = _inputs(rank)
    pair = hora.add_process_set(MEMBERS)
    other = hora.add_process_set([1, 2])
    out = {}
    if rank in MEMBERS:
        # every kind that draws automatic names, on the set only (rank 2 draws none)
        out["set"] = [hora.allreduce(x, op=hora.Sum, process_set=pair),
                      hora.allreduce(x, op=hora.Sum, process_set=pair),
                      hora.allgather(x[:1], process_set=pair),
                      hora.broadcast(x, root_rank=1, process_set=pair),
                      hora.allgather_object(("p", rank), process_set=pair),
                      hora.broadcast_object(rank, root_rank=0, process_set=pair)]
        hora.barrier(process_set=pair)
    if rank in other.ranks:
        # a set that overlaps the first one: rank 1 counts both, ranks 0 and 2 one each
        out["other"] = hora.allreduce(x, op=hora.Sum, process_set=other)
    handles = {"sum": hora.allreduce_async(x, op=hora.Sum),
               "gather": hora.allgather_async(x[:rank + 1]),
               "bcast": hora.broadcast_async(x, root_rank=2)}
    out["names"] = {k: h.name for k, h in handles.items()}
    out["global"] = {k: hora.synchronize(h) for k, h in handles.items()}
    out["objects"] = (hora.allgather_object(("r", rank)), hora.broadcast_object(rank * 7, 2))
    hora.barrier()
    return out


@pytest.mark.timeout(40)
def test_unnamed_collectives_on_a_set_leave_the_global_names_alone():
    results = run_ranks(_unnamed_after_set, SIZE, timeout_s=20)
    inputs = [_inputs(r) for r in range(SIZE)]
    pair_sum = sum(inputs[r] for r in MEMBERS)
    for rank, out in enumerate(results):
        if rank in MEMBERS:
            ar1, ar2, gather, bcast, objs, obj = out["set"]
            np.testing.assert_array_equal(ar1, pair_sum)
            np.testing.assert_array_equal(ar2, pair_sum)
            np.testing.assert_array_equal(gather, [inputs[r][0] for r in MEMBERS])
            np.testing.assert_array_equal(bcast, inputs[1])
            assert objs == [("p", r) for r in MEMBERS]
            assert obj == 0
        if rank in (1, 2):
            np.testing.assert_array_equal(out["other"], inputs[1] + inputs[2])
        res = out["global"]
        np.testing.assert_array_equal(res["sum"], sum(inputs))
        np.testing.assert_array_equal(
            res["gather"], np.concatenate([inputs[r][:r + 1] for r in range(SIZE)]))
        np.testing.assert_array_equal(res["bcast"], inputs[2])
        assert out["objects"] == ([("r", r) for r in range(SIZE)], 14)
        # the global set's names are what a job without process sets would use
        assert out["names"] == {"sum": "allreduce.noname.0", "gather": "allgather.noname.0",
                                "bcast": "broadcast.noname.0"}
