"""Rank 0's side of small allreduces and the response cache, in process (no sockets): inputs
travel with their requests, rank 0 reduces them as the data plane would, and every rank's
executor hands out the result; a request cached by the coordinator is then sent as its id."""
import functools

import numpy as np
import pytest

from hora.core.engine.executor import Executor
from hora.core.engine.folds import REDUCE
from hora.core.fusion import scale
from hora.core.engine.small import SMALL_ALLREDUCE, SmallReductions, payloads
from hora.core.handles import Handle
from hora.core.messages import (ADD_SET, ALLREDUCE, BROADCAST, REMOVE_SET, Average, Max,
                                Request, Sum)
from hora.core.negotiation import Coordinator
from hora.core.wire import Error, NewSet, Run, Shutdown, Tune, Value
from hora.errors import CollectiveMismatchError


def ar(name, shape=(4,), dtype="<f4", op=Sum, pre=1.0, post=1.0, ps=0):
    return Request(name, ALLREDUCE, dtype, (shape,), op, -1, pre, post, None, ps)


def _pending(req, arrays):
    return {(req.process_set, req.name): (req, arrays, Handle(req.name))}


def _oracle(inputs, op, pre, post):
    """Gather, then reduce in rank order, scaled as the data plane scales."""
    bufs = [np.array(x, copy=True).reshape(-1) for x in inputs]
    for b in bufs:
        scale(b, pre, 1)
    out = functools.reduce(lambda a, b: REDUCE[op](a, b, out=a), bufs[1:], bufs[0].copy())
    scale(out, post, len(inputs) if op == Average else 1)
    return out


@pytest.mark.parametrize("dtype,op,pre,post", [("<f4", Sum, 1.0, 1.0),
                                               ("<f4", Average, 0.5, 3.0),
                                               ("<i4", Sum, 1.0, 0.5),
                                               ("<f2", Max, 2.0, 1.0)])
def test_rank_0_reduces_every_members_input_as_the_data_plane_would(dtype, op, pre, post):
    n = 3
    c = Coordinator(n)
    small = SmallReductions(c)
    req = ar("x", (2, 3), dtype, op, pre, post)
    inputs = [np.arange(6, dtype=dtype).reshape(2, 3) * (r + 1) - r for r in range(n)]
    for rank in (1, 2):
        sent = payloads([req], _pending(req, [inputs[rank]]))
        small.take(rank, [req], sent, [])
        c.submit(rank, [req], now=0)
    mine = _pending(req, [inputs[0]])
    c.submit(0, [req], now=0)
    (resp,) = c.take_responses()
    value = small.settle(resp, mine)
    assert isinstance(value, Value) and value.names == ("x",)
    got = np.frombuffer(value.results[0], dtype=dtype)
    np.testing.assert_array_equal(got, _oracle(inputs, op, pre, post))


def test_only_small_host_allreduces_carry_their_input():
    big = ar("big", (SMALL_ALLREDUCE // 4 + 1,))
    bcast = Request("b", BROADCAST, "<f4", ((4,),), Sum, 0, 1.0, 1.0, None)
    on_gpu = ar("gpu")._replace(device="cuda")
    reqs = [ar("s", pre=2.0), big, bcast, on_gpu]
    pending = {}
    for q in reqs:
        pending.update(_pending(q, [np.ones(q.shapes[0], np.float32)]))
    sent = payloads(reqs, pending)
    assert list(sent) == [(0, "s")]
    assert np.frombuffer(sent[(0, "s")], "<f4").tolist() == [2.0] * 4      # prescaled


def test_a_missing_input_leaves_the_collective_to_the_data_plane():
    c = Coordinator(2)
    small = SmallReductions(c)
    req = ar("x")
    c.submit(1, [req], now=0)                       # rank 1's input did not come with it
    c.submit(0, [req], now=0)
    (resp,) = c.take_responses()
    assert small.settle(resp, _pending(req, [np.ones(4, np.float32)])) is resp


def test_an_error_drops_the_inputs_it_carried():
    c = Coordinator(2)
    small = SmallReductions(c)
    req = ar("x")
    small.take(1, [req], payloads([req], _pending(req, [np.ones(4, np.float32)])), [])
    err = Error(0, ("x",), "Mismatched shapes", "mismatch")
    assert small.settle(err, {}) is err
    # the next collective of that name starts afresh: rank 1's old input is gone
    c.submit(0, [req], now=0)
    c.submit(1, [req], now=0)
    (resp,) = c.take_responses()
    assert small.settle(resp, _pending(req, [np.ones(4, np.float32)])) is resp


def _executor(rank, size=2):
    released = []
    tunes = []
    ex = Executor(rank, size, None, released.append, on_tune=tunes.append)
    return ex, released, tunes


@pytest.mark.parametrize("inplace", [False, True])
def test_every_rank_takes_the_value_rank_0_computed(inplace):
    ex, released, _ = _executor(1)
    req = ar("x", (2, 2))
    mine = np.full((2, 2), 7.0, np.float32)
    handle = Handle("x")
    handle.inplace = inplace
    ex.pending[(0, "x")] = (req, [mine], handle)
    result = np.arange(4, dtype=np.float32)
    assert ex.run_all([Value(0, ("x",), (result.tobytes(),))]) is False
    (out,) = handle.wait(0)
    np.testing.assert_array_equal(out, result.reshape(2, 2))
    assert (out is mine) == inplace and released == [(0, "x")] and not ex.pending


def test_the_executor_fails_rejected_collectives_and_applies_cache_and_tune():
    ex, released, tunes = _executor(1)
    req = ar("x")
    handle = Handle("x")
    ex.pending[(0, "x")] = (req, [np.ones(4, np.float32)], handle)
    c = Coordinator(2)
    for _ in range(2):                          # the second identical time: cached
        c.submit(0, [req], now=0)
        c.submit(1, [req], now=0)
        responses = c.take_responses()
    assert ex.run_all([r for r in responses if r.tag == "cache"]) is False
    # the response cache: this rank now sends the id, and the coordinator reads it as req
    cache_id = ex.cache_ids[req]
    c.submit(0, [req], now=0)
    c.submit(1, [], now=0, cache_ids=[cache_id])
    assert c.take_responses() == [Run(ALLREDUCE, 0, ("x",))]
    ex.run_all([Error(0, ("x",), "Mismatched shapes for allreduce 'x'", "mismatch")])
    with pytest.raises(CollectiveMismatchError, match="Mismatched shapes"):
        handle.wait(0)
    assert ex.run_all([Tune(3.0), Shutdown(), Tune(9.0)]) is True
    assert tunes == [3.0] and released == [(0, "x")]


def test_process_sets_change_as_their_responses_run():
    ex, released, _ = _executor(1, size=3)
    handle = Handle("ps")
    add = Request("ps", ADD_SET, "", ((0, 2),), -1, -1, 1.0, 1.0, None)
    ex.pending[(0, "ps")] = (add, [], handle)
    ex.run_all([Run(ADD_SET, 0, ("ps",), NewSet(1, (0, 2)))])
    assert handle.wait(0) == 1 and ex.sets == {0: (0, 1, 2), 1: (0, 2)}
    # a collective of a set this rank is not in: nothing to run here
    ex.run_all([Run(ALLREDUCE, 1, ("x",))])
    ex.run_all([Run(REMOVE_SET, 0, ("rm",), 1)])
    assert ex.sets == {0: (0, 1, 2)} and released == [(0, "ps")]
