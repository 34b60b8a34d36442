"""Every collective on real processes, N = 1..3 and 7, checked against an independent numpy
oracle.

One job per N (tests/multiproc/collective_job.py: the inputs, the oracle, the cases and the
worker) runs every section and returns all results; the tests below check one section each
from the cached job.  A section that raises on a rank is reported with that rank's
traceback.  N = 1..3 run the broad matrix (every dtype x op x shape), N = 7 a smaller one.
The job for N = 3 runs with a tiny fusion threshold, so batched allreduces are fused into
many small buffers; the job for N = 2 ends with one big buffer.
"""
import numpy as np
import pytest

from tests.helpers import job_fixture, section
from tests.multiproc.collective_job import (
    BAD_CALLS, SMALL_FUSION_ENV, allgather_cases, allgather_input, allreduce_cases,
    allreduce_input, alltoall_cases, alltoall_plan, assert_reduced, broadcast_cases,
    broadcast_input, check_big_buffer, grouped_cases, grouped_input, obj_for,
    reducescatter_cases, reducescatter_input, worker)

# 4, 5, 6 and 8 have no path of their own: no plane, ring or board branches on N past N = 1
# (nor on a power of two).  2 is the pair (each rank both neighbours of the other), 3 the odd
# N of the broad matrix (with tiny fusion buffers), 7 the odd N of the smaller one and the
# most ranks (from 3 on, every N has more ranks than a 2-CPU machine has CPUs); 4, 6 and 8
# ran the same calls at an even N, which 2 runs with every case.
SIZES = [1, 2, 3, 7]

# 90 s: the 2-rank job runs the big buffer too (two jobs of 60 s before)
job = job_fixture(worker, env_for=lambda n: SMALL_FUSION_ENV if n == 3 else None,
                  timeout_s=90)


def assert_same_on_every_rank(values, what):
    for rank, v in enumerate(values[1:], start=1):
        assert v.dtype == values[0].dtype and v.shape == values[0].shape and \
            v.tobytes() == values[0].tobytes(), f"{what}: rank {rank} differs from rank 0"


def assert_reducescattered(got, case, n, r):
    """Rank r holds block r (the first rows % n ranks one row more) of the reduction."""
    dt, op, shape, pre, post = case
    q, extra = divmod(shape[0], n)
    bounds = np.cumsum([0] + [q + 1 if k < extra else q for k in range(n)])
    block = [reducescatter_input(case, k)[bounds[r]:bounds[r + 1]] for k in range(n)]
    assert_reduced(got, block, dt, op, pre, post, what=f"n={n} {case} rank {r}")


def expected_allgather(case, n):
    return np.concatenate([allgather_input(case, r).reshape((-1,) + case[1])
                           for r in range(n)])


def assert_alltoall(got, case, n, r):
    received, splits = got
    plans = [alltoall_plan(case, k, n) for k in range(n)]
    starts = [np.cumsum([0] + used) for _, _, used in plans]
    expected = np.concatenate([plans[j][0][starts[j][r]:starts[j][r + 1]] for j in range(n)])
    assert isinstance(splits, np.ndarray) and splits.dtype == np.int32, (case, r, splits)
    np.testing.assert_array_equal(splits, [plans[j][2][r] for j in range(n)],
                                  err_msg=f"{case} rank {r} received_splits")
    assert received.dtype == expected.dtype and received.shape == expected.shape, \
        (case, r, received.shape, expected.shape)
    np.testing.assert_array_equal(received, expected, err_msg=f"{case} rank {r}")


# -- the tests -------------------------------------------------------------------------------
pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("n", SIZES)
def test_job_runs_and_reports_topology(job, n):
    """The first test per N: its duration is the whole job's (start-up and every section)."""
    info = section(job(n), "info")
    assert info == [(r, n, r, n, 0, 1, True) for r in range(n)]


@pytest.mark.parametrize("n", SIZES)
def test_allreduce_every_dtype_op_shape_and_scaling(job, n):
    per_rank = section(job(n), "allreduce")
    for rank, (_, modified) in enumerate(per_rank):
        assert modified == [], f"rank {rank}: allreduce modified its input for {modified}"
    for case in allreduce_cases(n):
        dt, op, shape, pre, post, layout = case
        xs = [allreduce_input(case, r) for r in range(n)]
        got = [res[case] for res, _ in per_rank]
        assert_same_on_every_rank(got, str(case))
        assert_reduced(got[0], xs, dt, op, pre, post, what=f"n={n} {case}")


@pytest.mark.parametrize("n", SIZES)
def test_reducescatter_uneven_rows(job, n):
    per_rank = section(job(n), "reducescatter")
    for case in reducescatter_cases(n):
        for r in range(n):
            assert_reducescattered(per_rank[r][case], case, n, r)


@pytest.mark.parametrize("n", SIZES)
def test_allgather_different_first_dims(job, n):
    per_rank = section(job(n), "allgather")
    for case in allgather_cases(n):
        expected = expected_allgather(case, n)
        got = [res[case] for res in per_rank]
        assert_same_on_every_rank(got, str(case))
        assert got[0].dtype == np.dtype(case[0]) and got[0].shape == expected.shape, case
        np.testing.assert_array_equal(got[0], expected, err_msg=str(case))


@pytest.mark.parametrize("n", SIZES)
def test_broadcast_from_every_root(job, n):
    per_rank = section(job(n), "broadcast")
    for rank, (_, modified) in enumerate(per_rank):
        assert modified == [], f"rank {rank}: broadcast modified its input for {modified}"
    assert {case[2] for case in broadcast_cases(n)} == set(range(n))
    for case in broadcast_cases(n):
        expected = broadcast_input(case, case[2])
        for r, (res, _) in enumerate(per_rank):
            got = res[case]
            assert got.dtype == expected.dtype and got.shape == expected.shape, (case, r)
            np.testing.assert_array_equal(got, expected, err_msg=f"{case} rank {r}")


@pytest.mark.parametrize("n", SIZES)
def test_alltoall_uneven_and_default_splits(job, n):
    per_rank = section(job(n), "alltoall")
    for case in alltoall_cases(n):
        for r in range(n):
            assert_alltoall(per_rank[r][case], case, n, r)


@pytest.mark.parametrize("n", SIZES)
def test_grouped_allreduce_mixed_dtypes(job, n):
    per_rank = section(job(n), "grouped")
    for i, (op, pre, post, items) in enumerate(grouped_cases()):
        for mode in ("sync", "async"):
            for r in range(n):
                got = per_rank[r][i, mode]
                assert isinstance(got, list) and len(got) == len(items), (i, mode, r, got)
                for j, (dt, shape) in enumerate(items):
                    xs = [grouped_input(i, j, k) for k in range(n)]
                    assert_reduced(got[j], xs, dt, op, pre, post,
                                   what=f"n={n} group {i} item {j} ({mode}) rank {r}")


@pytest.mark.parametrize("n", SIZES)
def test_async_handles_poll_and_synchronize(job, n):
    per_rank = section(job(n), "async")
    for r, (out, polls, done) in enumerate(per_rank):
        assert polls <= {bool} and done, (r, polls, done)
        for (kind, case), got in out.items():
            if kind == "allreduce":
                xs = [allreduce_input(case, k) for k in range(n)]
                assert_reduced(got, xs, case[0], case[1], case[3], case[4], what=str(case))
            elif kind == "reducescatter":
                assert_reducescattered(got, case, n, r)
            elif kind == "allgather":
                np.testing.assert_array_equal(got, expected_allgather(case, n), err_msg=str(case))
            elif kind == "broadcast":
                np.testing.assert_array_equal(got, broadcast_input(case, case[2]))
            else:
                assert_alltoall(got, case, n, r)
        assert len(out) == len(per_rank[0][0])


@pytest.mark.parametrize("n", SIZES)
def test_auto_naming_and_submission_order(job, n):
    per_rank = section(job(n), "naming")
    total = n * (n + 1) / 2
    for r, ((hb, ha), ordered, dup, reused) in enumerate(per_rank):
        np.testing.assert_array_equal(ha, np.full(3, total))
        np.testing.assert_array_equal(hb, np.arange(5) * n + n * (n - 1) // 2)
        for name, got in ordered.items():
            k = int(name.split(".")[1])
            np.testing.assert_array_equal(got, np.full(k + 1, n - 1.0), err_msg=name)
        if n > 1:
            assert dup == "DuplicateNameError", f"rank {r}: a second name in flight gave {dup}"
        np.testing.assert_array_equal(reused, np.ones(2) * n * (n - 1) / 2)


@pytest.mark.parametrize("n", SIZES)
def test_bad_arguments_raise_on_every_rank(job, n):
    per_rank = section(job(n), "errors")
    expected = {key: exc for key, (exc, _) in BAD_CALLS.items()}
    if n == 1:
        expected["alltoall_uneven_rows"] = None
    for r, (got, after) in enumerate(per_rank):
        assert got == expected, f"rank {r}: {got}"
        np.testing.assert_array_equal(after, [n * (n - 1) / 2, n])


def _deep_equal(a, b):
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(
            _deep_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_deep_equal, a, b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("n", SIZES)
def test_broadcast_object_and_allgather_object(job, n):
    per_rank = section(job(n), "objects")
    for r, (roots, default, gathered, nones) in enumerate(per_rank):
        for root, got in roots.items():
            assert _deep_equal(got, obj_for(root)), f"rank {r} root {root}: {got!r}"
        assert _deep_equal(default, obj_for(0)), f"rank {r}: {default!r}"
        assert _deep_equal(gathered, [obj_for(k) for k in range(n)]), f"rank {r}"
        assert nones == [None] * n


@pytest.mark.parametrize("n", SIZES)
def test_barrier_waits_for_every_rank(job, n):
    per_rank = section(job(n), "barrier")
    last_in = max(entered for entered, _ in per_rank)
    for r, (_, left) in enumerate(per_rank):
        assert left >= last_in, f"rank {r} left the barrier before rank 0 arrived"


# one big buffer: chunking, pipelining and partial reductions in flight
def test_big_buffer_two_ranks(job):
    """One 128 MiB buffer, the last section of the 2-rank job."""
    check_big_buffer(section(job(2), "big"))
