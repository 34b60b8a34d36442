"""Core collective semantics on real ranks, as Horovod's tests catch them.

* join(): the calls ranks make while others have joined leave their automatic names apart,
  and a collective still pending when the last rank joins is settled first; the collectives
  after every join agree, and join() returns the last rank to join on every rank.
* An alltoall this rank cannot submit (rows that do not divide without splits, splits that
  do not sum to the first dimension or are not integers) raises ``InvalidArgumentError``
  on that rank from its own check: a ``ValueError`` (torch, TensorFlow) and a
  ``RuntimeError`` (MXNet) alike, ``tf.errors.InvalidArgumentError`` in TensorFlow.
* A name submitted again while its first call is pending raises ``ValueError`` on that
  rank, for every collective, and the job goes on.
* A collective on a process set this rank is not a member of raises ``ValueError`` on that
  rank (Horovod's invalid argument), in every binding; the members run theirs.
* Ranks that each wait for a name no other rank submitted fail with one error naming what
  each waits for, once the stall inspector has asked them (HORA_STALL_CHECK_TIME_SECONDS),
  instead of stalling for good.

TensorFlow's, JAX's and MXNet's cases are sections of test_tf_ops.py's, test_jax_ops.py's
and test_mxnet_ops.py's jobs, which start those frameworks' ranks anyway.
"""
import time

import numpy as np
import pytest

from tests.helpers import caught as _caught, job_fixture, run_ranks, section

pytestmark = pytest.mark.timeout(180)

WAIT_S = 15.0       # a collective that should complete at once; longer is a hang


# -- the NumPy API, on 3 ranks ----------------------------------------------------------------
def _join_names():
    """Each rank in turn joins while the others allgather (refused), then every rank joins and
    gathers what join() returned; then an unnamed allreduce."""
    import hora
    r, n, out = hora.rank(), hora.size(), []
    for i in range(n):
        refused = None
        if r != i:
            refused = _caught(lambda: hora.allgather(np.ones((2, 2)) * r))
        last = hora.join()
        out.append((refused, last, hora.allgather_object(last)))
    total = hora.synchronize(hora.allreduce_async(np.array([r + 1.0]), op=hora.Sum),
                             timeout=WAIT_S)
    return out, float(total[0])


def _join_settles_pending():
    """Rank 0's allreduce waits for ranks 1 and 2, which join instead (rank 2 last)."""
    import hora
    r = hora.rank()
    handle = None
    if r == 0:
        handle = hora.allreduce_async(np.array([5.0]), op=hora.Sum, name="before.join")
    if r == 2:
        time.sleep(1.0)
    last = hora.join()
    got = None if handle is None else float(hora.synchronize(handle, timeout=WAIT_S)[0])
    return last, got


def _alltoall_args():
    import hora
    r, n = hora.rank(), hora.size()
    out = {
        "uneven": _caught(lambda: hora.alltoall(np.ones(n + 1))),
        "sum": _caught(lambda: hora.alltoall(np.ones(n - 1), splits=np.ones(n, np.int32))),
        "float": _caught(lambda: hora.alltoall(np.ones(n), splits=np.ones(n, np.float32))),
        "one_rank": _caught(lambda: hora.alltoall(np.ones(n + (r == 0)), name="a2a.one")),
    }
    got, splits = hora.alltoall(np.arange(2.0 * n), splits=[2] * n, name="a2a.after")
    return out, got.tolist(), splits.tolist()


def _duplicates():
    """Rank 0 submits each name twice before the others submit it once."""
    import hora
    r, n = hora.rank(), hora.size()
    calls = {
        "allreduce": lambda k: hora.allreduce_async(np.ones(n), op=hora.Sum, name=k),
        "grouped_allreduce": lambda k: hora.grouped_allreduce_async([np.ones(n)], op=hora.Sum,
                                                                    name=k),
        "allgather": lambda k: hora.allgather_async(np.ones(n), name=k),
        "broadcast": lambda k: hora.broadcast_async(np.ones(n), 0, name=k),
        "alltoall": lambda k: hora.alltoall_async(np.ones(n), name=k),
        "reducescatter": lambda k: hora.reducescatter_async(np.ones(n), op=hora.Sum, name=k),
        "barrier": lambda k: hora.barrier_async(name=k),
    }
    out = {}
    for kind, call in calls.items():
        name = f"dup.{kind}"
        if r == 0:
            first = call(name)
            out[kind] = _caught(lambda: call(name))
        hora.barrier()
        if r != 0:
            first = call(name)
        hora.synchronize(first, timeout=WAIT_S)
        hora.barrier()
    return out


def _nonmember():
    """Members 0 and 1 run each collective on their set; rank 2 calls it too, same name."""
    import hora
    r = hora.rank()
    ps = hora.add_process_set([0, 1])
    x = np.arange(4.0) + r
    calls = {
        "allreduce": lambda: hora.allreduce(x, op=hora.Sum, name="x", process_set=ps),
        "allreduce_": lambda: hora.allreduce_(x.copy(), op=hora.Sum, name="x_",
                                              process_set=ps),
        "grouped_allreduce": lambda: hora.grouped_allreduce([x], op=hora.Sum, name="gx",
                                                            process_set=ps),
        "allgather": lambda: hora.allgather(x, name="g", process_set=ps),
        "grouped_allgather": lambda: hora.grouped_allgather([x], name="gg", process_set=ps),
        "broadcast": lambda: hora.broadcast(x, 0, name="b", process_set=ps),
        "alltoall": lambda: hora.alltoall(x, name="a", process_set=ps),
        "reducescatter": lambda: hora.reducescatter(x, op=hora.Sum, name="rs",
                                                    process_set=ps),
        "barrier": lambda: hora.barrier(process_set=ps),
        "allgather_object": lambda: hora.allgather_object(r, process_set=ps),
    }
    out = {}
    for kind, call in calls.items():
        try:
            got = call()
            if kind.startswith("grouped") or kind == "alltoall":
                got = got[0]                # (the first array; alltoall's received rows)
            out[kind] = ("ok", None if got is None else np.asarray(got).tolist())
        except Exception as e:  # noqa: BLE001 - what was raised is the result
            out[kind] = (type(e).__name__, isinstance(e, ValueError), str(e))
    hora.barrier()
    return out, hora.allreduce(np.array([1.0]), op=hora.Sum, name="after.nonmember").tolist()


def _numpy_worker(n):
    from tests.helpers import run_sections
    return run_sections({"join_names": _join_names, "join_settles": _join_settles_pending,
                         "alltoall": _alltoall_args, "duplicates": _duplicates,
                         "nonmember": _nonmember})


numpy_job = job_fixture(_numpy_worker, timeout_s=90)


def test_collectives_after_join_agree_on_their_names(numpy_job):
    results = section(numpy_job(3), "join_names")
    for r, (rounds, total) in enumerate(results):
        for i, (refused, last, gathered) in enumerate(rounds):
            if r != i:
                assert refused and refused[2] and "join" in refused[3], (r, i, refused)
            assert last == results[0][0][i][1], (r, i, last)
            assert gathered == [last] * 3, (r, i, gathered)
        assert total == 6.0, (r, total)


def test_a_collective_pending_when_the_last_rank_joins_completes_first(numpy_job):
    results = section(numpy_job(3), "join_settles")
    assert [last for last, _ in results] == [2, 2, 2], results
    assert results[0][1] == 5.0, results          # the joined ranks contributed zeros


def test_alltoall_arguments_raise_value_and_runtime_error_on_the_rank(numpy_job):
    results = section(numpy_job(3), "alltoall")
    for r, (out, got, splits) in enumerate(results):
        for key, words in (("uneven", "multiple of the number of ranks"),
                           ("sum", "summing to the first dimension"),
                           ("float", "integers")):
            name, is_value, is_runtime, text = out[key]
            assert (name, is_value, is_runtime) == ("InvalidArgumentError", True, True), \
                (r, key, out[key])
            assert words in text, (r, key, text)
        if r == 0:
            assert out["one_rank"][:3] == ("InvalidArgumentError", True, True), out["one_rank"]
        else:
            assert out["one_rank"][0] == "CollectiveAbortedError", (r, out["one_rank"])
            assert "rank 0" in out["one_rank"][3]
        assert got == [2.0 * r, 2.0 * r + 1] * 3 and splits == [2, 2, 2], (r, got, splits)


def test_a_duplicate_name_raises_value_error_and_the_job_goes_on(numpy_job):
    results = section(numpy_job(3), "duplicates")
    for kind, caught in results[0].items():
        assert caught is not None, f"rank 0: a second {kind} of a pending name raised nothing"
        name, is_value, _, text = caught
        assert name == "DuplicateNameError" and is_value and f"dup.{kind}" in text, \
            (kind, caught)


def test_a_collective_on_a_set_without_this_rank_raises_value_error(numpy_job):
    results = section(numpy_job(3), "nonmember")
    x = [np.arange(4.0) + r for r in range(3)]
    want = {"allreduce": (x[0] + x[1]).tolist(), "allreduce_": (x[0] + x[1]).tolist(),
            "grouped_allreduce": (x[0] + x[1]).tolist(), "barrier": None,
            "allgather": np.concatenate(x[:2]).tolist(),
            "grouped_allgather": np.concatenate(x[:2]).tolist(),
            "broadcast": x[0].tolist(), "allgather_object": [0, 1]}
    for r in (0, 1):
        out, after = results[r]
        for kind, value in want.items():
            assert out[kind] == ("ok", value), (r, kind, out[kind])
        assert out["alltoall"] == ("ok", [x[0][2 * r], x[0][2 * r + 1], x[1][2 * r],
                                          x[1][2 * r + 1]]), (r, out["alltoall"])
        assert out["reducescatter"] == ("ok", (x[0] + x[1])[2 * r:2 * r + 2].tolist()), \
            (r, out["reducescatter"])
        assert after == [3.0]
    out, after = results[2]
    for kind, caught in out.items():
        name, is_value, text = caught
        assert name == "InvalidArgumentError" and is_value, (kind, caught)
        assert "rank 2 is not a member" in text, (kind, text)
    assert after == [3.0]


def _names_apart():
    """Each rank waits for a name no other rank submits; then the job goes on."""
    import hora
    r = hora.rank()
    started = time.monotonic()
    caught = _caught(lambda: hora.allgather(np.ones(1), name=f"apart.{r}"))
    took = time.monotonic() - started
    hora.barrier()
    return caught, took, hora.allgather_object(r)


def test_ranks_that_wait_for_names_no_other_rank_submitted_fail_within_a_bound():
    results = run_ranks(_names_apart, 2, timeout_s=60,
                        env={"HORA_STALL_CHECK_TIME_SECONDS": "1"})
    for r, (caught, took, after) in enumerate(results):
        assert caught is not None and caught[0] == "CollectiveMismatchError", (r, caught)
        text = caught[3]
        assert "deadlocked" in text, text
        assert "rank 0 waits for allgather 'apart.0', which rank 1 did not submit" in text
        assert "rank 1 waits for allgather 'apart.1', which rank 0 did not submit" in text
        assert took < 20.0, (r, took)
        assert after == [0, 1]


# -- the bindings, on 2 ranks: rank 1 is not in the set {0} ----------------------------------
def _torch_worker(n):
    import torch

    import hora.torch as hvd
    from tests.helpers import run_sections
    r = hvd.rank()

    def join_then_objects():
        # the program: a refused allgather on one rank, then allgather_object
        out = []
        for i in range(2):
            if r == i:
                ret = hvd.join()
            else:
                assert _caught(lambda: hvd.allgather(torch.ones(2, 2) * r)) is not None
                ret = hvd.join()
            out.append((ret, hvd.allgather_object(ret)))
        return out

    def alltoall():
        return {"uneven": _caught(lambda: hvd.alltoall(torch.empty(n + 1))),
                "sum": _caught(lambda: hvd.alltoall(torch.empty(n - 1),
                                                    torch.ones(n, dtype=torch.int32))),
                "float": _caught(lambda: hvd.alltoall(torch.empty(n),
                                                      torch.empty(n, dtype=torch.float32)))}

    def duplicate_reducescatter():
        t = torch.ones(2 * n)
        caught = None
        if r == 0:
            first = hvd.reducescatter_async(t, name="dup.rs", op=hvd.Sum)
            caught = _caught(lambda: hvd.reducescatter_async(t, name="dup.rs", op=hvd.Sum))
        hvd.barrier()
        if r != 0:
            first = hvd.reducescatter_async(t, name="dup.rs", op=hvd.Sum)
        got = hvd.synchronize(first).tolist()
        hvd.barrier()
        return caught, got

    def nonmember():
        ps = hvd.add_process_set([0])
        t = torch.ones(2)
        calls = {"allreduce": lambda: hvd.allreduce(t, process_set=ps),
                 "allreduce_async_": lambda: hvd.synchronize(
                     hvd.allreduce_async_(t.clone(), process_set=ps)),
                 "allgather": lambda: hvd.allgather(t, process_set=ps),
                 "broadcast": lambda: hvd.broadcast(t, 0, process_set=ps),
                 "alltoall": lambda: hvd.alltoall(t, process_set=ps),
                 "reducescatter": lambda: hvd.reducescatter(t, process_set=ps),
                 "grouped_allreduce": lambda: hvd.grouped_allreduce([t], process_set=ps)}
        out = {kind: _caught(call) for kind, call in calls.items()}
        hvd.barrier()
        return out

    return run_sections({"join": join_then_objects, "alltoall": alltoall,
                         "duplicate": duplicate_reducescatter, "nonmember": nonmember})


torch_job = job_fixture(_torch_worker, timeout_s=120)


def test_torch_join_then_allgather_object(torch_job):
    results = section(torch_job(2), "join")
    assert results[0] == results[1] == [(1, [1, 1]), (0, [0, 0])], results


def test_torch_alltoall_arguments_raise_value_error(torch_job):
    for r, out in enumerate(section(torch_job(2), "alltoall")):
        for key, caught in out.items():
            assert caught is not None and caught[1], (r, key, caught)


def test_torch_reducescatter_async_duplicate_name_raises_value_error(torch_job):
    results = section(torch_job(2), "duplicate")
    assert results[0][0] is not None and results[0][0][1], results[0]
    assert results[1][0] is None
    assert results[0][1] == [2.0, 2.0] and results[1][1] == [2.0, 2.0], results


def test_torch_collectives_on_a_set_without_this_rank_raise_value_error(torch_job):
    members, other = section(torch_job(2), "nonmember")
    for kind, caught in other.items():
        assert caught is not None and caught[1] and "not a member" in caught[3], (kind, caught)
    assert all(caught is None for caught in members.values()), members
