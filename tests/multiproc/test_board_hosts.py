"""The board across hosts (hora.core.engine.board): blocking small allreduces and barriers of
a job on several hosts, on real ranks on two "hosts" of this machine.

``hora.runner.run(..., hosts="localhost:2,127.0.0.1:2")`` places ranks on two host names that
are both this machine: each rank's HORA_HOSTNAME says which, so the topology sees 2 hosts of
2 ranks (the hierarchical data plane: real shared memory inside each host, real TCP between
them).  Each host has a board of its own; its lowest rank leads it; global rank 0 leads the
first host.  A blocking allreduce of fewer than ``STRIPE_BYTES`` (64 KiB) on the global set,
and a blocking barrier, settle on the boards: the workers post, each leader reduces its
host's inputs in rank order and sends the partial to rank 0, which adds the partials in host
order, scales, and answers.

* The result is that reduction, bit for bit, on every rank; the metrics count exactly those
  calls under ``data_plane["board"]``, once per call on every rank.  Larger, asynchronous
  and process-set allreduces go through the engine (not counted there).
* Falling back to the engine, barriers, joins and process sets across hosts are
  test_board_hosts_fallback.py's; mismatches, a long mixed loop and a dead rank
  test_board_hosts_errors.py's.
* ``HORA_SHM_BOARD=0``: no board, the engine's results.
* Hosts of one rank each (``localhost:1,127.0.0.1:1``), or of different sizes
  (``localhost:1,127.0.0.1:3``): the TCP ring is the data plane, and each host has a board all
  the same (a host of one rank, a board of one), with the same results, errors and failures.

Expected values are computed here, from the inputs each rank returns.

With the board on, one job per host list (``board_on``) runs the correctness calls (first:
its counts start from none), then the lane loop and hora.torch's calls where a test asks for
them (each counting from its own start); each test checks its own part.  The board-off runs
are jobs of their own.
"""
import importlib.util

import numpy as np
import pytest

import hora
from tests.helpers import cached, run_sections, section
from tests.multiproc.board_oracle import board_count as _board_count
from tests.multiproc.board_oracle import call as _call
from tests.multiproc.board_oracle import case_input as _input
from tests.multiproc.board_oracle import close as _close
from tests.multiproc.board_oracle import expected as _expected
from tests.multiproc.board_oracle import nbytes as _nbytes
from tests.multiproc.board_oracle import same_bits as _same_bits
from tests.multiproc.board_hosts_jobs import (E32, FOUR_ONES, HOSTS, HOSTS_3, OFF, ONE_THREE,
                                              STRIPE_BYTES, THREE_HOSTS, TWO_ONE)
from tests.multiproc.board_hosts_jobs import host_groups as _host_groups
from tests.multiproc.board_hosts_jobs import run_on as _run
from tests.multiproc.board_hosts_jobs import where as _where

pytestmark = pytest.mark.timeout(60)


# -- 1. correctness: dtypes, ops, scaling, shapes, in place, grouped, the 64 KiB limit -------
CASES = [
    # (tag, api, dtype, shapes, op, prescale, postscale)
    ("f32.sum.1", "allreduce", "float32", [(1,)], "Sum", 1.0, 1.0),
    ("f32.avg.3x4", "allreduce", "float32", [(3, 4)], "Average", 1.0, 1.0),
    ("f32.min", "allreduce", "float32", [(5,)], "Min", 1.0, 1.0),
    ("f32.max.scaled.inplace", "allreduce_", "float32", [(5,)], "Max", 2.0, 0.5),
    ("f32.prod.scaled.inplace", "allreduce_", "float32", [(2, 3)], "Product", 1.5, 0.75),
    ("f32.avg.postscaled", "allreduce", "float32", [(7,)], "Average", 1.0, 3.0),
    ("f64.sum", "allreduce", "float64", [(9,)], "Sum", 1.0, 1.0),
    ("f64.avg.scaled", "allreduce", "float64", [(3, 4)], "Average", 0.5, 3.0),
    ("f64.min.prescaled", "allreduce", "float64", [(4,)], "Min", 1.5, 1.0),
    ("f64.max.inplace", "allreduce_", "float64", [(5,)], "Max", 1.0, 1.0),
    ("f64.prod", "allreduce", "float64", [(6,)], "Product", 1.0, 1.0),
    ("f16.sum.scaled", "allreduce", "float16", [(17,)], "Sum", 0.25, 2.0),
    ("f16.avg.inplace", "allreduce_", "float16", [(3, 4)], "Average", 1.0, 1.0),
    ("f16.min", "allreduce", "float16", [(6,)], "Min", 1.0, 1.0),
    ("f16.max.scaled", "allreduce", "float16", [(6,)], "Max", 0.5, 1.0),
    ("f16.prod", "allreduce", "float16", [(5,)], "Product", 1.0, 1.0),
    ("i32.sum", "allreduce", "int32", [(3, 4)], "Sum", 1.0, 1.0),
    ("i32.avg.scaled.inplace", "allreduce_", "int32", [(7,)], "Average", 3.0, 0.5),
    ("i32.min.prescaled", "allreduce", "int32", [(6,)], "Min", 0.7, 1.0),
    ("i32.max", "allreduce", "int32", [(6,)], "Max", 1.0, 1.0),
    ("i32.prod", "allreduce", "int32", [(5,)], "Product", 1.0, 1.0),
    ("i64.sum.postscaled", "allreduce", "int64", [(5,)], "Sum", 1.0, 0.3),
    ("i64.avg", "allreduce", "int64", [(5,)], "Average", 1.0, 1.0),
    ("i64.min", "allreduce", "int64", [(4,)], "Min", 1.0, 1.0),
    ("i64.max.inplace", "allreduce_", "int64", [(4,)], "Max", 1.0, 1.0),
    ("i64.prod", "allreduce", "int64", [(4,)], "Product", 1.0, 1.0),
    ("f64.0d", "allreduce", "float64", [()], "Sum", 1.0, 1.0),
    ("f32.0d.avg", "allreduce", "float32", [()], "Average", 1.0, 1.0),
    ("i64.0d.max", "allreduce", "int64", [()], "Max", 1.0, 1.0),
    ("f32.empty", "allreduce", "float32", [(0,)], "Sum", 1.0, 1.0),
    ("i64.empty.2d", "allreduce", "int64", [(3, 0)], "Max", 1.0, 1.0),
    ("f32.transposed.inplace", "allreduce_T", "float32", [(4, 3)], "Sum", 1.0, 1.0),
    ("f64.strided", "allreduce_strided", "float64", [(10,)], "Sum", 1.0, 1.0),
    ("grouped.f32", "grouped", "float32", [(3,), (2, 2)], "Sum", 2.0, 1.0),
    ("grouped.f64.avg", "grouped", "float64", [(5,), (1,), (2, 3)], "Average", 1.0, 1.0),
    ("grouped.f16.max", "grouped", "float16", [(4,), (3,)], "Max", 1.0, 1.0),
    ("grouped.i64.prod", "grouped", "int64", [(3,), (4,)], "Product", 1.0, 1.0),
    # just below 64 KiB: still the boards
    ("f32.below", "allreduce", "float32", [(E32 - 1,)], "Sum", 0.5, 1.0),
    ("f32.below.avg.inplace", "allreduce_", "float32", [(E32 - 1,)], "Average", 1.0, 3.0),
    ("f64.below.prod", "allreduce", "float64", [(E32 // 2 - 1,)], "Product", 1.0, 1.0),
    ("f16.below", "allreduce", "float16", [(2 * E32 - 1,)], "Sum", 0.25, 2.0),
    ("i32.below.avg.inplace", "allreduce_", "int32", [(E32 - 1,)], "Average", 3.0, 1.0),
    ("i64.below.min", "allreduce", "int64", [(E32 // 2 - 1,)], "Min", 1.0, 1.0),
    ("grouped.below", "grouped", "float32", [(E32 // 2,), (E32 // 2 - 1,)], "Max", 1.0, 1.0),
    # 64 KiB and more: the engine
    ("f32.at", "allreduce", "float32", [(E32,)], "Sum", 1.0, 1.0),
    ("f32.above", "allreduce", "float32", [(E32 + 1,)], "Sum", 1.0, 1.0),
    ("grouped.at", "grouped", "float32", [(E32 // 2,), (E32 // 2,)], "Sum", 1.0, 1.0),
    ("f64.big.avg", "allreduce", "float64", [(E32,)], "Average", 0.5, 1.0),
    ("i32.big.max.inplace", "allreduce_", "int32", [(4 * E32 + 3,)], "Max", 1.0, 1.0),
    ("f32.small.after", "allreduce", "float32", [(3,)], "Sum", 1.0, 1.0),
]


ON_BOARD = [_nbytes(c[2], c[3]) < STRIPE_BYTES for c in CASES]


def _correctness_worker():
    rank = hora.rank()
    out = []
    for i, (tag, api, dtype, shapes, op_name, pre, post) in enumerate(CASES):
        op = getattr(hora, op_name)
        xs = [_input(i, dtype, s, op_name, rank) for s in shapes]
        kept = [x.copy() for x in xs]
        kw = dict(op=op, name=tag, prescale_factor=pre, postscale_factor=post)
        got, same = _call(api, xs, kw)
        out.append((kept, [np.array(g, copy=True) for g in got], same, _board_count()))
    return _where(), out, hora.metrics()["data_plane"]


def _check_job(results, hosts, board):
    """Every rank's results of a correctness job: the same bits everywhere; the boards' calls
    (``board``: the job had them on) the oracle's bits, counted once each; the engine's within
    float tolerance of the oracle (equal for integers)."""
    groups = _host_groups([r[0] for r in results], hosts)
    n = len(results)
    for rank, (_, cases, planes) in enumerate(results):
        assert len(cases) == len(CASES)
        for i, (tag, api, dtype, shapes, op, pre, post) in enumerate(CASES):
            kept, got, same, count = cases[i]
            what = f"rank {rank} {tag}" + ("" if board else " (board off)")
            assert same, f"{what}: the in-place result is not in the caller's array"
            if board:
                want_count = sum(ON_BOARD[:i + 1])
                assert count == want_count, \
                    f"{what}: {count} allreduces on the board after it, expected {want_count}"
            else:
                assert count == 0, f"{what}: {count} on the board"
            for j, shape in enumerate(shapes):
                inputs = [results[r][1][i][0][j] for r in range(n)]
                want = _expected(inputs, op, pre, post, groups)
                assert got[j].shape == shape, (what, got[j].shape, shape)
                _same_bits(got[j], results[0][1][i][1][j], f"{what}[{j}] vs rank 0")
                if board and ON_BOARD[i]:
                    _same_bits(got[j], want, f"{what}[{j}] vs the boards' reduction")
                else:
                    _close(got[j], want, f"{what}[{j}] vs numpy")
        if board:
            assert planes.get("board") == sum(ON_BOARD), planes
            engine = sum(planes.values()) - planes["board"]
            assert engine == len(CASES) - sum(ON_BOARD), planes
        else:
            assert "board" not in planes, planes
            assert sum(planes.values()) == len(CASES), planes


_HAS_TORCH = importlib.util.find_spec("torch") is not None


def _parts(hosts):
    """The parts of the board-on job on ``hosts``, in order."""
    if hosts == HOSTS:
        return ("correctness", "lanes") + (("torch",) if _HAS_TORCH else ())
    return ("correctness", "lanes") if hosts == TWO_ONE else ("correctness",)


def _sections(parts):
    workers = {"correctness": _correctness_worker, "lanes": _lanes_worker,
               "torch": _torch_worker}
    return run_sections({name: workers[name] for name in parts})


@pytest.fixture(scope="module")
def board_on():
    """``board_on(hosts)``: every rank's parts of the board-on job on ``hosts`` (cached)."""
    jobs = {}

    def get(hosts):
        return cached(jobs, hosts, lambda: _run(_sections, hosts=hosts, args=(_parts(hosts),),
                                                timeout_s=80), f"the job on {hosts}")
    return get


@pytest.mark.timeout(90)
def test_results_on_two_hosts_of_two_bit_for_bit_and_with_the_board_off(board_on):
    """4 ranks on 2 hosts: every call gives every rank the same bits; below 64 KiB the bits of
    the per-host-then-across-hosts reduction, counted on the board; from 64 KiB on, and with
    HORA_SHM_BOARD=0, the engine's (within float tolerance, equal for integers)."""
    on = section(board_on(HOSTS), "correctness")
    _check_job(on, HOSTS, board=True)
    off = _run(_correctness_worker, env=OFF)
    _check_job(off, HOSTS, board=False)
    for rank in range(len(on)):
        for i, (tag, _, dtype, shapes, *_rest) in enumerate(CASES):
            for j in range(len(shapes)):
                _same_bits(on[rank][1][i][0][j], off[rank][1][i][0][j], f"{tag} input")
                if np.dtype(dtype).kind == "i":
                    _same_bits(on[rank][1][i][1][j], off[rank][1][i][1][j],
                               f"rank {rank} {tag}[{j}]: board vs engine")


@pytest.mark.timeout(90)
def test_results_on_two_hosts_of_three_bit_for_bit():
    """6 ranks, 3 on each host: each host reduces 3 inputs in rank order before the hosts'
    partials meet at rank 0."""
    _check_job(_run(_correctness_worker, hosts=HOSTS_3, timeout_s=70), HOSTS_3, board=True)


@pytest.mark.timeout(90)
def test_results_on_three_hosts_of_two_bit_for_bit():
    """6 ranks on 3 hosts (127.0.0.2 is this machine too): rank 0 adds two other leaders'
    partials, in host order."""
    _check_job(_run(_correctness_worker, hosts=THREE_HOSTS, timeout_s=70), THREE_HOSTS,
               board=True)


# 4x1 is the hosts of one rank each (2x1 took no path of its own: rank 0 adds three boards'
# partials there instead of one, the same code); 2+1 and 1+3 hosts of different sizes, with
# rank 0's board of two ranks or of one
@pytest.mark.parametrize("hosts", [FOUR_ONES, TWO_ONE, ONE_THREE], ids=["4x1", "2+1", "1+3"])
def test_results_on_hosts_the_ring_serves_bit_for_bit_and_with_the_board_off(board_on, hosts):
    """One rank on each host, or hosts of different sizes (the TCP ring is the data plane):
    each host has a board all the same (a host of one rank leads a board of one, whose
    partial is its own prescaled input), so below 64 KiB the bits of the per-host-then-
    across-hosts reduction; from 64 KiB on, and with HORA_SHM_BOARD=0, the engine's."""
    _check_job(section(board_on(hosts), "correctness"), hosts, board=True)
    _check_job(_run(_correctness_worker, hosts=hosts, env=OFF), hosts, board=False)


def _lanes_worker():
    from tests.multiproc.test_board_lanes import LANE_STEPS, _lane_loop
    before = _board_count()
    calls, lanes, folds, board, stripes = _lane_loop(LANE_STEPS)
    return _where(), (calls, lanes, folds, board - before, stripes)


@pytest.mark.parametrize("hosts", [HOSTS, TWO_ONE], ids=["2x2", "2+1"])
def test_a_repeated_call_keeps_its_lane_across_hosts(board_on, hosts):
    """test_board.py's loop of one name, now and then with another dtype, shape, layout, op,
    postscale, or as a copy, on two hosts: every result has the bits of the per-host-then-
    across-hosts reduction on every rank; the boards settled every call, and the lanes (host
    rounds, whose result every rank copies) every one but the array's neither flat nor
    contiguous."""
    from tests.multiproc.test_board_lanes import LANE_STEPS, _lane_case
    results = section(board_on(hosts), "lanes")
    groups = _host_groups([r[0] for r in results], hosts)
    general = sum(_lane_case(i)[0] == "T" for i in range(LANE_STEPS))
    n = len(results)
    for rank, (_, (calls, lanes, folds, board, stripes)) in enumerate(results):
        assert board == LANE_STEPS, (rank, board)
        assert (lanes, folds, stripes) == (LANE_STEPS - general, 0, 0), (rank, lanes, folds)
        for i, (tag, kept, got) in enumerate(calls):
            _, _, dtype, shape, op, post = _lane_case(i)
            with np.errstate(over="ignore"):
                want = _expected([results[r][1][0][i][1] for r in range(n)], op, 1.0, post,
                                 groups)
            _same_bits(got, want, f"rank {rank} call {i} ({tag})")


# -- 5. hora.torch ----------------------------------------------------------------------------
def _torch_worker():
    import torch
    import hora.torch as hvd
    rank = hvd.rank()
    rng = np.random.default_rng(rank)
    ins, outs, same, deltas = [], [], [], []
    for i, dtype in enumerate([torch.float32, torch.float64, torch.int32, torch.int64,
                               torch.float16]):
        t = torch.from_numpy(rng.integers(-20, 20, size=(3, 2))).to(dtype)
        ins.append(t.clone().numpy())
        before = _board_count()
        r = hvd.allreduce_(t, op=hvd.Sum, name=f"t.{i}")
        deltas.append(_board_count() - before)
        same.append(r is t)
        outs.append(t.numpy().copy())
    x = torch.from_numpy((rng.standard_normal(7) * 10).astype(np.float32))
    before = _board_count()
    avg = hvd.allreduce(x, name="avg")                          # Average, by default
    y = torch.from_numpy(rng.standard_normal(5) * 10)
    scaled = hvd.allreduce(y, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0,
                           name="scaled")
    deltas.append(_board_count() - before)
    big = torch.ones(E32 + 1, dtype=torch.float32)              # 64 KiB + 4: the engine
    before = _board_count()
    hvd.allreduce_(big, op=hvd.Sum, name="big")
    deltas.append(_board_count() - before)
    return (_where(), ins, outs, same, x.numpy(), avg.numpy(), y.numpy(), scaled.numpy(),
            big.numpy(), deltas)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
@pytest.mark.timeout(90)
def test_torch_allreduces_of_small_cpu_tensors_go_through_the_boards(board_on):
    results = section(board_on(HOSTS), "torch")
    groups = _host_groups([r[0] for r in results])
    n = len(results)
    for rank, (_, ins, outs, same, x, avg, y, scaled, big, deltas) in enumerate(results):
        assert all(same), same
        for i, got in enumerate(outs):
            _same_bits(got, _expected([results[r][1][i] for r in range(n)], "Sum",
                                      groups=groups), f"rank {rank} t.{i}")
        _same_bits(avg, _expected([results[r][4] for r in range(n)], "Average", groups=groups),
                   f"rank {rank} avg")
        _same_bits(scaled, _expected([results[r][6] for r in range(n)], "Sum", 0.5, 3.0,
                                     groups=groups), f"rank {rank} scaled")
        _same_bits(big, np.full(E32 + 1, float(n), np.float32), f"rank {rank} big")
        assert deltas == [1] * len(outs) + [2, 0], f"rank {rank}: counted on the board: {deltas}"
