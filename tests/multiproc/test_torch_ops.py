"""``hora.torch``'s collectives on real processes, checked against torch on the gathered inputs.

One job per N in 2 and 3 runs every section (allreduce, allgather, broadcast, alltoall,
reducescatter, grouped ops, async handles, compression, join: torch_ops_cases.py; gradients,
gradcheck, process sets, bad input: torch_ops_grads.py) and returns everything; the tests
below check one section each.

Why these N: 2 runs the sections only a pair of ranks can (the grouped gradients and a bad
later tensor); 3 is the one where the even ranks' process set maps a rank to another set
rank (global 2 is set rank 1, which the binding's gradients and broadcast roots translate)
beside a set of one rank, and where ranks outnumber a power of two.  There is no job of 4:
its two sets of two ranks each run the same binding code as N=3's set of two, and
concurrent sets are the core's (test_process_sets.py).  There is no job of 1 either: the
binding's collectives have no branch on the job's size, the core's one-rank path is
test_collectives.py's job of 1 rank, with every collective, and the optimizer's is
test_torch_optimizer.py's.
"""
import time
import traceback
import warnings

import pytest
import torch

from tests.helpers import job_fixture, section
from tests.multiproc import torch_ops_cases, torch_ops_grads
from tests.multiproc.torch_ops_cases import (
    FP16_TOL, GROUPED_RS, GROUPS, allgather_cases, allgather_input, allreduce_cases,
    allreduce_input, alltoall_cases, alltoall_expected, alltoall_plan, assert_tensor,
    async_expected, broadcast_cases, broadcast_input, compression_cases, compression_input,
    grouped_gather_input, grouped_input, grouped_rs_input, reduce_expected, reducescatter_cases,
    reducescatter_expected, reducescatter_input, values)
from tests.multiproc.torch_ops_grads import (
    ad_cases, ad_expected, ad_grads, ad_inputs, bad_calls, gc_cases, grouped_ad_cases,
    grouped_ad_inputs, ps_ad_cases)

SIZES = [2, 3]
_SECTIONS = {**torch_ops_cases.SECTIONS, **torch_ops_grads.SECTIONS}


def _worker(n):
    import hora.torch as hvd
    torch.set_num_threads(1)
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, run in _SECTIONS.items():
            started = time.monotonic()
            try:
                out[name] = ("ok", run(hvd, n), time.monotonic() - started)
            except Exception:
                out[name] = ("error", traceback.format_exc(), time.monotonic() - started)
    out["warnings"] = ("ok", [f"{w.category.__name__}: {w.message}" for w in caught], 0.0)
    return out


job = job_fixture(_worker)


def assert_flags(flags, inplace, grad, what):
    same, unchanged, shares, requires_grad = flags
    if inplace:
        assert same, f"{what}: the in-place op did not return its input tensor"
    else:
        assert not same and unchanged and not shares, \
            f"{what}: out-of-place op returned its input / modified it / shares its memory"
    assert requires_grad == grad, f"{what}: output requires_grad is {requires_grad}"


# -- the tests -------------------------------------------------------------------------------
pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("n", SIZES)
def test_job_runs_every_section_without_warnings(job, n):
    """The first test per N: its duration is the whole job's."""
    results = job(n)
    assert section(results, "info") == [(r, n, False) for r in range(n)]
    for r, caught in enumerate(section(results, "warnings")):
        assert caught == [], f"rank {r} warned: {caught}"


@pytest.mark.parametrize("n", SIZES)
def test_allreduce_every_dtype_op_variant(job, n):
    per_rank = section(job(n), "allreduce")
    for case in allreduce_cases(n):
        dt, op, shape, pre, post, variant = case
        exp = reduce_expected([allreduce_input(case, k) for k in range(n)], op, pre, post)
        for r in range(n):
            got, flags = per_rank[r][case]
            what = f"n={n} {case} rank {r}"
            assert_tensor(got, exp, what)
            assert_flags(flags, variant.startswith("inplace"), variant == "grad", what)


@pytest.mark.parametrize("n", SIZES)
def test_allgather_broadcast_alltoall_reducescatter(job, n):
    per_rank = section(job(n), "collectives")
    for case in allgather_cases(n):
        xs = [allgather_input(case, k) for k in range(n)]
        exp = torch.cat([x.reshape((-1,) + case[1]) for x in xs])
        for r in range(n):
            got, flags = per_rank[r]["ag", case]
            assert_tensor(got, exp, f"allgather n={n} {case} rank {r}")
            assert_flags(flags, False, case[3] == "grad", f"allgather {case}")
    for case in broadcast_cases(n):
        exp = broadcast_input(case, case[2])
        for r in range(n):
            got, flags = per_rank[r]["bc", case]
            assert_tensor(got, exp, f"broadcast n={n} {case} rank {r}")
            assert_flags(flags, case[3].startswith("inplace"), case[3] == "grad",
                         f"broadcast {case} rank {r}")
    for case in alltoall_cases(n):
        plans = [alltoall_plan(case, k, n) for k in range(n)]
        for r in range(n):
            is_tuple, got, splits, flags = per_rank[r]["a2a", case]
            exp, exp_splits = alltoall_expected([p[0] for p in plans], [p[2] for p in plans], r)
            assert is_tuple == (plans[r][1] is not None), f"alltoall {case}: return convention"
            assert_tensor(got, exp, f"alltoall n={n} {case} rank {r}")
            if is_tuple:
                assert_tensor(splits, exp_splits, f"alltoall {case} rank {r} received splits")
            assert_flags(flags, False, "grad" in case[2], f"alltoall {case}")
    for case in reducescatter_cases(n):
        xs = [reducescatter_input(case, k) for k in range(n)]
        for r in range(n):
            got, flags = per_rank[r]["rs", case]
            exp = reducescatter_expected(xs, r, case[1], case[3], case[4])
            assert_tensor(got, exp, f"reducescatter n={n} {case} rank {r}")
            assert_flags(flags, False, case[5] == "grad", f"reducescatter {case}")


@pytest.mark.parametrize("n", SIZES)
def test_grouped_ops(job, n):
    per_rank = section(job(n), "grouped")
    for r, res in enumerate(per_rank):
        for i, (op, pre, post, items) in enumerate(GROUPS):
            for variant in ("sync", "inplace", "inplace_nc"):
                got, same, is_list = res["ar", i, variant]
                assert is_list and len(got) == len(items), (i, variant)
                assert all(same) == (variant != "sync") and any(same) == all(same), (i, variant)
                for j in range(len(items)):
                    exp = reduce_expected([grouped_input(i, j, k) for k in range(n)], op, pre, post)
                    assert_tensor(got[j], exp, f"grouped_allreduce {i}.{j} {variant} rank {r}")
        for j in range(3):
            exp = torch.cat([grouped_gather_input(j, k) for k in range(n)])
            assert_tensor(res["ag"][j], exp, f"grouped_allgather {j} rank {r}")
        for i, (op, pre, post) in enumerate(GROUPED_RS):
            assert isinstance(res["rs", i], list) and len(res["rs", i]) == 2
            for j in range(2):
                xs = [grouped_rs_input(i, j, k, n) for k in range(n)]
                assert_tensor(res["rs", i][j], reducescatter_expected(xs, r, op, pre, post),
                              f"grouped_reducescatter {i}.{j} rank {r}")


@pytest.mark.parametrize("n", SIZES)
def test_async_handles_poll_and_synchronize(job, n):
    for r, (res, poll_types, same) in enumerate(section(job(n), "async")):
        assert poll_types == {"bool"}, (r, poll_types)
        assert same == {"ar_": True, "bc_": True, "gar_": [True, True]}, (r, same)
        for key, got in res.items():
            exp = async_expected(key, n, r)
            if isinstance(exp, tuple):                       # alltoall_async: always a pair
                assert isinstance(got, tuple) and len(got) == 2, (key, type(got))
            if isinstance(exp, (list, tuple)):
                assert type(got) is type(exp) and len(got) == len(exp), (key, got)
                for j, (g, e) in enumerate(zip(got, exp)):
                    assert_tensor(g, e, f"{key}[{j}] rank {r}")
            else:
                assert_tensor(got, exp, f"{key} rank {r}")


@pytest.mark.parametrize("n", SIZES)
def test_compression_fp16_keeps_dtype(job, n):
    per_rank = section(job(n), "compression")
    for case in compression_cases(n):
        fn, dt, op, _ = case
        for r in range(n):
            got = per_rank[r][case]
            for j in range(2 if fn.startswith("grouped") else 1):
                xs = [compression_input(case, k, j) for k in range(n)]
                exp = (reducescatter_expected(xs, r, op) if fn.endswith("reducescatter")
                       else reduce_expected(xs, op))
                assert_tensor(got[j] if fn.startswith("grouped") else got, exp,
                              f"{case}[{j}] rank {r}", tol=FP16_TOL)


@pytest.mark.parametrize("n", SIZES)
def test_join_and_barrier(job, n):
    per_rank = section(job(n), "join")
    lasts = {last for last, _ in per_rank}
    assert len(lasts) == 1 and lasts <= set(range(n)), lasts
    if n > 1:
        assert lasts != {0}, "rank 0 joined first, yet join() says it was last"
    for r, (_, y) in enumerate(per_rank[1:], start=1):    # rank 0 joined: it adds zeros
        assert_tensor(y, torch.full((3,), float(sum(range(1, n)))), f"join rank {r}")


def _check_gradients(per_rank, cases, n, inputs):
    for case in cases:
        for r in range(n):
            assert per_rank[r][case] != "not differentiable", f"{case}: no grad_fn on rank {r}"
        xs = [inputs(case, k, n) for k in range(n)]
        gs = [ad_grads(case, k, per_rank[k][case][1]) for k in range(n)]
        for r in range(n):
            got, _ = per_rank[r][case]
            exp = ad_expected(case, n, list(range(n)), r, xs, gs)
            tol = FP16_TOL if "fp16" in case[0] else None
            for i, (g, e) in enumerate(zip(got, exp)):
                assert_tensor(g, e, f"gradient of {case} input {i} rank {r}", tol=tol)


@pytest.mark.parametrize("n", SIZES)
def test_gradients_match_their_definitions(job, n):
    _check_gradients(section(job(n), "autograd"), ad_cases(n), n, ad_inputs)


@pytest.mark.parametrize("n", [2])
def test_grouped_allgather_and_reducescatter_are_differentiable(job, n):
    _check_gradients(section(job(n), "grouped_autograd"), grouped_ad_cases(n), n,
                     grouped_ad_inputs)


@pytest.mark.parametrize("n", SIZES)
def test_gradcheck_every_differentiable_op(job, n):
    per_rank = section(job(n), "gradcheck")
    assert len(per_rank[0]) >= len(gc_cases(n))
    for r, res in enumerate(per_rank):
        failed = {key: why for key, why in res.items() if why != "ok"}
        assert not failed, f"rank {r}: {failed}"


@pytest.mark.parametrize("n", SIZES)
def test_process_sets(job, n):
    per_rank = section(job(n), "process_sets")
    for r, out in enumerate(per_rank):
        members = [k for k in range(n) if k % 2 == r % 2]
        me, m = members.index(r), len(members)
        assert out["members"] == members
        v = lambda what, dt, shape, k: values(("ps", what, k), dt, shape)  # noqa: E731
        assert_tensor(out["allreduce"], sum(v("ar", "float32", (4,), k) for k in members),
                      f"allreduce rank {r}")
        same, x = out["allreduce_"]
        assert same
        assert_tensor(x, reduce_expected([v("ar_", "int32", (3,), k) for k in members],
                                         "Average"), f"allreduce_ rank {r}")
        assert_tensor(out["allgather"], torch.cat([v("ag", "int16", (k % 3, 2), k)
                                                   for k in members]), f"allgather rank {r}")
        assert_tensor(out["broadcast"], v("bc", "float64", (3,), members[-1]), "broadcast")
        assert_tensor(out["broadcast_"], v("bc_", "uint8", (2,), members[0]), "broadcast_")
        used = [[(i + j) % 3 for j in range(m)] for i in range(m)]
        xs = [v("a2a", "float32", (sum(used[i]),), k) for i, k in enumerate(members)]
        exp, exp_splits = alltoall_expected(xs, used, me)
        assert_tensor(out["alltoall"][0], exp, f"alltoall rank {r}")
        assert_tensor(out["alltoall"][1], exp_splits, f"alltoall splits rank {r}")
        xs = [v("rs", "float64", (2 * m + 1, 2), k) for k in members]
        assert_tensor(out["reducescatter"], reducescatter_expected(xs, me, "Sum"), "rs")
        for j, (dt, shape) in enumerate([("float32", (2,)), ("int8", ())]):
            exp = reduce_expected([v(f"g{j}", dt, shape, k) for k in members], "Max")
            assert_tensor(out["grouped"][j], exp, f"grouped_allreduce {j} rank {r}")
        for case in ps_ad_cases(members):
            xs = [ad_inputs(case, k, n) for k in members]
            got, _ = out["ad", case[:2]]
            gs = [ad_grads(case, k, per_rank[k]["ad", case[:2]][1]) for k in members]
            for g, e in zip(got, ad_expected(case, n, members, me, xs, gs)):
                assert_tensor(g, e, f"set gradient of {case} rank {r}")
        failed = {k: why for k, why in out.items() if k[0] == "gc" and why != "ok"}
        assert not failed, f"rank {r}: {failed}"


@pytest.mark.parametrize("n", SIZES)
def test_bad_input_raises_at_once_and_the_names_stay_in_step(job, n):
    """Every rank makes the same bad calls: each raises its own error at once, and the
    unnamed collectives after them still pair up (the failed calls took their names)."""
    per_rank = section(job(n), "errors")
    for r, (got, _, _, _) in enumerate(per_rank):
        for key, (exc, _) in bad_calls(None).items():
            assert got[key] is not None, f"rank {r} {key}: no error"
            assert got[key][0] == exc, f"rank {r} {key}: {got[key][0]}: {got[key][1]}"
            assert got[key][2] < 1.0, f"rank {r} {key}: took {got[key][2]:.1f} s to fail"
    for r, (_, after, _, _) in enumerate(per_rank):
        stuck = [k for k, v in after.items() if isinstance(v, str)]
        assert not stuck, f"rank {r}: collectives after the bad calls never finished: {stuck}"
        assert len(after) == 9
        total = float(sum(range(n)))
        assert_tensor(after["allreduce"], torch.full((2 * n,), total), f"rank {r}")
        assert_tensor(after["allreduce_"], torch.full((2 * n,), total), f"rank {r}")
        assert_tensor(after["broadcast"], torch.zeros(2 * n), f"rank {r}")
        assert_tensor(after["allgather"], torch.arange(n, dtype=torch.float32), f"rank {r}")


@pytest.mark.parametrize("n", [2])
def test_grouped_reducescatter_bad_later_tensor_fails_the_other_ranks(job, n):
    per_rank = section(job(n), "errors")
    assert per_rank[-1][2] == "TypeError"
    assert [late for _, _, late, _ in per_rank[:-1]] == ["CollectiveAbortedError"] * (n - 1)
    for r, (_, _, _, after) in enumerate(per_rank):
        assert not isinstance(after, str), f"rank {r}: the next reducescatter never finished"
        assert_tensor(after, torch.full((1,), float(n)), f"rank {r}")
