"""The public surface: Horovod's names, and a job of one process with no launcher."""
import numpy as np
import pytest

import hora

HOROVOD_NAMES = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank",
                 "local_size", "cross_rank", "cross_size", "is_homogeneous", "allreduce",
                 "allreduce_async", "grouped_allreduce", "grouped_allreduce_async", "allgather",
                 "allgather_async", "broadcast", "broadcast_async", "alltoall", "alltoall_async",
                 "reducescatter", "reducescatter_async", "barrier", "broadcast_object",
                 "allgather_object", "poll", "synchronize", "Average", "Sum", "Adasum", "Min",
                 "Max", "Product", "HorovodInternalError"]


def test_horovod_names_are_exported():
    missing = [n for n in HOROVOD_NAMES if not hasattr(hora, n)]
    assert not missing
    assert set(HOROVOD_NAMES) <= set(hora.__all__)
    assert all(hasattr(hora, n) for n in hora.__all__)
    # Horovod's ReduceOp values
    assert (hora.Average, hora.Sum, hora.Adasum, hora.Min, hora.Max, hora.Product) == tuple(
        range(6))


@pytest.fixture
def alone():
    hora.init()
    yield
    hora.shutdown()
    assert not hora.is_initialized()


def test_a_script_without_launcher_is_a_job_of_one(alone):
    assert (hora.rank(), hora.size(), hora.local_rank(), hora.local_size()) == (0, 1, 0, 1)
    assert (hora.cross_rank(), hora.cross_size(), hora.is_homogeneous()) == (0, 1, True)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(hora.allreduce(x), x)
    np.testing.assert_array_equal(hora.allreduce(x, op=hora.Sum, postscale_factor=2), 2 * x)
    np.testing.assert_array_equal(hora.allgather(x), x)
    np.testing.assert_array_equal(hora.broadcast(x, 0), x)
    out, splits = hora.alltoall(x)
    np.testing.assert_array_equal(out, x)
    assert splits.tolist() == [2]
    np.testing.assert_array_equal(hora.reducescatter(x, op=hora.Sum), x)
    hora.barrier()
    h = hora.allreduce_async(x, name="h")
    np.testing.assert_array_equal(hora.synchronize(h), x)
    assert hora.poll(h)
    assert hora.broadcast_object({"a": [1, 2]}) == {"a": [1, 2]}
    assert hora.allgather_object(("x", 1)) == [("x", 1)]
    assert hora.allreduce(x, average=False).dtype == np.float32


def test_bad_arguments_are_typed_errors_at_the_edge(alone):
    with pytest.raises(TypeError, match="bool"):
        hora.allreduce(np.array([True, False]))             # Average of bools
    with pytest.raises(NotImplementedError, match="Adasum"):
        hora.allreduce(np.ones(2), op=hora.Adasum)
    with pytest.raises(ValueError, match="splits"):
        hora.alltoall(np.ones(4), splits=[1, 2])
    with pytest.raises(TypeError, match="dtype"):
        hora.allreduce(np.array(["a"]))
    with pytest.raises(TypeError, match="root_rank"):
        hora.broadcast(np.ones(2), root_rank="0")
    with pytest.raises(ValueError, match="op= or the deprecated average="):
        hora.allreduce(np.ones(2), op=hora.Sum, average=True)
    # nothing was left half-submitted: the job still works
    np.testing.assert_array_equal(hora.allreduce(np.ones(2), op=hora.Sum), np.ones(2))


def test_init_twice_is_a_no_op_and_shutdown_is_idempotent():
    hora.init()
    hora.init()
    hora.shutdown()
    hora.shutdown()
    with pytest.raises(hora.NotInitializedError):
        hora.size()
