"""The coordinator's decisions, in process (no sockets): order, fusion, errors, shutdown."""
from hora.core.messages import (ADD_SET, ALLGATHER, AMONG, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, JOIN,
                                Request, Sum)
from hora.core.negotiation import Coordinator


def ar(name, shape=(4,), dtype="<f4", op=Sum, pre=1.0, post=1.0):
    return Request(name, ALLREDUCE, dtype, (shape,), op, -1, pre, post, None)


def test_runs_only_what_every_rank_submitted_in_completion_order():
    c = Coordinator(3, fusion_threshold=0)
    c.submit(0, [ar("a"), ar("b")], now=0)
    c.submit(1, [ar("b"), ar("a")], now=0)
    assert c.take_responses() == []
    c.submit(2, [ar("b")], now=0)
    c.submit(2, [ar("a")], now=0)
    assert c.take_responses() == [("run", ALLREDUCE, 0, ("b",), None),
                                  ("run", ALLREDUCE, 0, ("a",), None)]


def test_ready_allreduces_of_one_kind_are_fused_up_to_the_threshold():
    c = Coordinator(2, fusion_threshold=40)           # 2 tensors of 16 bytes fit, 3 do not
    names = ["g0", "g1", "g2", "h0"]
    reqs = [ar("g0"), ar("g1"), ar("g2"), ar("h0", dtype="<f8")]
    c.submit(0, reqs, now=0)
    c.submit(1, reqs, now=0)
    assert [r[3] for r in c.take_responses()] == [("g0", "g1"), ("g2",), ("h0",)]
    assert names


def test_non_allreduce_between_allreduces_keeps_the_order():
    c = Coordinator(2)
    bc = Request("w", BROADCAST, "<f4", ((3,),), -1, 0, 1.0, 1.0, None)
    for rank in (0, 1):
        c.submit(rank, [ar("a"), bc, ar("b")], now=0)
    out = c.take_responses()
    assert [(r[1], r[3]) for r in out] == [(ALLREDUCE, ("a",)), (BROADCAST, ("w",)),
                                           (ALLREDUCE, ("b",))]


def test_allgather_and_alltoall_carry_every_ranks_sizes():
    c = Coordinator(2)
    c.submit(0, [Request("g", ALLGATHER, "<i4", ((2, 3),), -1, -1, 1.0, 1.0, None),
                 Request("t", ALLTOALL, "<i4", ((3,),), -1, -1, 1.0, 1.0, (1, 2))], now=0)
    c.submit(1, [Request("g", ALLGATHER, "<i4", ((5, 3),), -1, -1, 1.0, 1.0, None),
                 Request("t", ALLTOALL, "<i4", ((4,),), -1, -1, 1.0, 1.0, None)], now=0)
    assert c.take_responses() == [("run", ALLGATHER, 0, ("g",), (2, 5)),
                                  ("run", ALLTOALL, 0, ("t",), ((1, 2), (2, 2)))]


def test_mismatch_names_the_tensor_the_ranks_and_the_values():
    c = Coordinator(3)
    c.submit(0, [ar("grad", shape=(4,))], now=0)
    c.submit(1, [ar("grad", shape=(5,))], now=0)
    c.submit(2, [ar("grad", shape=(4,))], now=0)
    [(tag, set_id, names, message, why, _)] = c.take_responses()
    assert (tag, set_id, names, why) == ("error", 0, ("grad",), "mismatch")
    assert message == ("Mismatched shapes for allreduce 'grad': ranks 0, 2: (4,); rank 1: (5,)")


def test_kind_mismatch_is_reported_before_anything_else():
    c = Coordinator(2)
    c.submit(0, [ar("x")], now=0)
    c.submit(1, [Request("x", ALLGATHER, "<f4", ((4,),), -1, -1, 1.0, 1.0, None)], now=0)
    [(_, _, _, message, _, _)] = c.take_responses()
    assert message.startswith("Mismatched collective kinds for 'x'")


def test_a_departed_rank_fails_what_it_will_never_submit_then_all_shut_down():
    c = Coordinator(3)
    c.submit(0, [ar("late")], now=0)
    c.depart(2)
    [(tag, _, names, message, why, _)] = c.take_responses()
    assert (tag, names, why) == ("error", ("late",), "shutdown") and "rank 2" in message
    c.submit(1, [ar("later")], now=1)
    assert c.take_responses()[0][:3] == ("error", 0, ("later",))
    c.depart(0)
    assert c.take_responses() == []
    c.depart(1)
    assert c.take_responses() == [("shutdown",)]
    assert c.take_responses() == []


def test_a_rank_that_submitted_before_it_departed_still_completes_the_collective():
    c = Coordinator(3)
    c.submit(0, [ar("x")], now=0)
    c.submit(2, [ar("x")], now=0)
    c.depart(2)                                  # rank 2 shut down with "x" in flight
    assert c.take_responses() == []
    c.submit(1, [ar("x")], now=1)
    assert c.take_responses() == [("run", ALLREDUCE, 0, ("x",), None)]
    c.depart(0)
    c.depart(1)
    assert c.take_responses() == [("shutdown",)]


def test_barrier_needs_no_data_and_stalls_are_reported_per_rank():
    c = Coordinator(3)
    barrier = Request("b", BARRIER, "", ((),), -1, -1, 1.0, 1.0, None)
    c.submit(0, [barrier, ar("x")], now=10)
    c.submit(1, [barrier], now=12)
    assert c.stalled(now=20, after=60) == {}
    assert c.stalled(now=75, after=60) == {1: ["x"], 2: ["b", "x"]}
    c.submit(2, [barrier], now=80)
    assert c.take_responses() == [("run", BARRIER, 0, ("b",), None)]


def test_process_sets_have_their_own_members_and_names():
    c = Coordinator(4)
    add = Request("ps.add", ADD_SET, "", ((1, 3),), -1, -1, 1.0, 1.0, None)
    for r in range(4):
        c.submit(r, [add], now=0)
    [(tag, kind, _, names, (set_id, ranks))] = c.take_responses()
    assert (tag, kind, ranks) == ("run", ADD_SET, (1, 3)) and set_id == 1
    in_set = Request("x", ALLREDUCE, "<f4", ((2,),), Sum, -1, 1.0, 1.0, None, 1)
    c.submit(1, [in_set, ar("x")], now=0)           # same name, different sets
    c.submit(3, [in_set], now=0)
    assert c.take_responses() == [("run", ALLREDUCE, 1, ("x",), None)]
    c.submit(0, [in_set], now=0)                    # rank 0 is not a member
    [(tag, _, _, message, why, detail)] = c.take_responses()
    assert tag == "error" and "rank 0 is not a member of process set 1" in message
    assert why == "nonmember" and list(detail) == [0]        # rank 0's call alone fails


def test_a_set_its_members_add_waits_for_them_alone():
    c = Coordinator(4)
    add = Request("ps.among", ADD_SET, "", ((0, 2),), -1, AMONG, 1.0, 1.0, None)
    c.submit(0, [add], now=0)
    assert c.take_responses() == [] and c.stalled(now=10, after=5) == {2: ["ps.among"]}
    c.submit(2, [add], now=1)                       # ranks 1 and 3 never call
    [(tag, kind, _, _, (set_id, ranks))] = c.take_responses()
    assert (tag, kind, set_id, ranks) == ("run", ADD_SET, 1, (0, 2))
    c.submit(1, [add._replace(name="ps.among.2")], now=2)     # not one of its ranks
    [(tag, _, _, message, why, detail)] = c.take_responses()
    assert tag == "error" and why == "nonmember" and list(detail) == [1], message
    assert c.idle()


def test_a_deadlock_of_names_that_differ_fails_what_every_rank_waits_for():
    c = Coordinator(3)
    c.submit(0, [ar("a")], now=0)
    c.submit(1, [ar("a")], now=0)
    c.submit(2, [ar("b")], now=0)
    assert c.deadlock({0: "a", 1: "a"}) is None             # rank 2 may still submit a
    assert c.deadlock({0: "a", 1: "a", 2: "a"}) is None     # rank 2 did not submit a
    message = c.deadlock({0: "a", 1: "a", 2: "b"})
    assert "rank 0 waits for allreduce 'a', which rank 2 did not submit" in message
    assert "rank 2 waits for allreduce 'b', which ranks 0, 1 did not submit" in message
    out = c.take_responses()
    assert [(r[0], r[2], r[4]) for r in out] == [("error", ("a",), "mismatch"),
                                                ("error", ("b",), "mismatch")]
    assert out[0][3] == message and c.idle()


def test_the_last_join_first_settles_what_waited_for_the_joined_ranks():
    c = Coordinator(3)
    join = Request("join", JOIN, "", ((),), -1, -1, 1.0, 1.0, None)
    c.submit(0, [ar("x")], now=0)
    c.submit(1, [join], now=0)
    c.submit(0, [join], now=0)
    assert c.take_responses() == []
    c.submit(2, [join], now=0)                      # x waited for ranks 1 and 2
    [(_, kind, _, names, (joined, _)), last] = c.take_responses()
    assert (kind, names, joined) == (ALLREDUCE, ("x",), (1, 2))
    assert last == ("run", JOIN, 0, ("join",), 2) and c.idle()


def test_joined_ranks_contribute_to_allreduce_and_join_returns_the_last():
    c = Coordinator(3)
    join = Request("join", JOIN, "", ((),), -1, -1, 1.0, 1.0, None)
    c.submit(1, [join], now=0)
    c.submit(0, [ar("g")], now=0)
    assert c.take_responses() == []
    c.submit(2, [ar("g")], now=0)
    [(tag, kind, set_id, names, (joined, req))] = c.take_responses()
    assert (tag, kind, names, joined, req.name) == ("run", ALLREDUCE, ("g",), (1,), "g")
    bc = Request("b", BROADCAST, "<f4", ((3,),), -1, 0, 1.0, 1.0, None)
    c.submit(0, [bc], now=0)
    c.submit(2, [bc], now=0)
    [(tag, _, _, message, _, _)] = c.take_responses()
    assert tag == "error" and "rank 1 called join()" in message
    c.submit(2, [join], now=0)
    c.submit(0, [join], now=0)
    assert c.take_responses() == [("run", JOIN, 0, ("join",), 0)]


# -- the response cache -------------------------------------------------------------------------
def _step(c, reqs_by_rank, ids_by_rank=None):
    for rank, reqs in reqs_by_rank.items():
        c.submit(rank, reqs, now=0, cache_ids=(ids_by_rank or {}).get(rank, ()))
    return c.take_responses()


def test_an_identical_request_is_cached_the_second_time_and_then_sent_as_its_id():
    c = Coordinator(2, cache_capacity=8)
    g = ar("grad")
    first = _step(c, {0: [g], 1: [g]})
    assert [r[0] for r in first] == ["run"]                     # seen once: not cached yet
    second = _step(c, {0: [g], 1: [g]})
    assert ("cache", 0, g) in second and second[-1][:4] == ("run", ALLREDUCE, 0, ("grad",))
    assert c.cached_request(0) == g
    # rank 1 now sends only the id; rank 0 the request itself: the same collective
    third = _step(c, {0: [g], 1: []}, {1: [0]})
    assert third == [("run", ALLREDUCE, 0, ("grad",), None)]


def test_requests_that_differ_between_ranks_or_change_are_not_cached():
    c = Coordinator(2, cache_capacity=8)
    for i in range(3):
        # auto-named: a new name each time, never identical twice
        out = _step(c, {0: [ar(f"allreduce.noname.{i}")], 1: [ar(f"allreduce.noname.{i}")]})
        assert all(r[0] != "cache" for r in out)
    for _ in range(3):                                   # a shape mismatch: an error, no cache
        out = _step(c, {0: [ar("m", shape=(4,))], 1: [ar("m", shape=(5,))]})
        assert [r[0] for r in out] == ["error"]


def test_cache_capacity_bounds_the_entries_and_zero_disables_it():
    c = Coordinator(2, cache_capacity=2)
    for _ in range(2):
        out = _step(c, {r: [ar("a"), ar("b"), ar("c")] for r in (0, 1)})
    assert sorted(r[1] for r in out if r[0] == "cache") == [0, 1]
    out = _step(c, {r: [ar("a"), ar("b"), ar("c")] for r in (0, 1)})
    assert all(r[0] != "cache" for r in out)                     # full: c is sent in full
    off = Coordinator(2, cache_capacity=0)
    for _ in range(3):
        assert all(r[0] != "cache" for r in _step(off, {r: [ar("a")] for r in (0, 1)}))


def _cached(c, reqs, size):
    """Submit ``reqs`` on every rank twice, so that they are cached; their ids."""
    ids = {}
    for _ in range(2):
        ids.update((r[2], r[1]) for r in _step(c, {k: reqs for k in range(size)})
                   if r[0] == "cache")
    return [ids[q] for q in reqs]


def test_the_offer_is_what_the_last_ranks_cached_submission_yields():
    c = Coordinator(3, fusion_threshold=40)     # two 16-byte tensors fuse, a third does not
    grads = [ar("g0"), ar("g1"), ar("g2")]
    ids = _cached(c, grads, 3)
    assert c.offer() is None                           # nothing pending
    c.submit(0, grads, now=0)
    assert c.offer() is None                           # two ranks missing
    c.submit(2, [], now=0, cache_ids=ids)
    rank, offered, answer = c.offer(8)
    assert (rank, offered) == (1, tuple(ids))
    assert c.offer(16) is None                          # not larger than min_bytes
    c.submit(1, [], now=0, cache_ids=list(offered))
    got = c.take_responses()
    assert list(answer) == got == [("run", ALLREDUCE, 0, ("g0", "g1"), None),
                                   ("run", ALLREDUCE, 0, ("g2",), None)]


def test_no_offer_for_rank_0_uncached_differing_joined_or_departed():
    def fresh():
        c = Coordinator(2)
        return c, _cached(c, [ar("g")], 2)
    c, ids = fresh()
    c.submit(1, [], now=0, cache_ids=ids)
    assert c.offer() is None                           # rank 0 is the one missing
    c, ids = fresh()
    c.submit(0, [ar("new")], now=0)
    assert c.offer() is None                           # not cached
    c, ids = fresh()
    c.submit(0, [ar("g")], now=0)
    assert c.offer()[1] == tuple(ids)
    c.submit(0, [Request("b", BARRIER, "", (), -1, -1, 1.0, 1.0, None)], now=0)
    assert c.offer() is None                           # something else pending
    c, ids = fresh()
    c.submit(0, [ar("g")], now=0)
    c.submit(0, [Request("join", JOIN, "", (), -1, -1, 1.0, 1.0, None)], now=0)
    assert c.offer() is None
    c, ids = fresh()
    c.submit(0, [ar("g")], now=0)
    c.depart(0)
    assert c.offer() is None
    c3 = Coordinator(3)                                 # ranks 0 and 2 differ: no offer
    ids = _cached(c3, [ar("g")], 3)
    c3.submit(0, [ar("g")], now=0)
    c3.submit(2, [ar("g", shape=(5,))], now=0)
    assert c3.offer() is None


def test_a_cached_request_sent_in_full_stands_as_the_cached_one():
    """Rank 0's engine sends itself its requests in full; one equal to a cached request
    counts as that request, so a collective whose hosts and ranks all sent it is complete
    without comparing every rank's (the cost of a collective at rank 0 grows with the
    messages, not with the ranks behind them)."""
    n, per_host = 64, 8
    c = Coordinator(n)
    grads = [ar("g0"), ar("g1", shape=(2, 3))]
    ids = _cached(c, grads, n)
    c.submit(0, [ar("g0"), ar("g1", shape=(2, 3))], now=1.0)    # equal, other objects
    for r in range(1, per_host):
        c.submit(r, [], now=1.0, cache_ids=ids)
    for first in range(per_host, n - per_host, per_host):
        c.submit_host(tuple(range(first, first + per_host)), ids, now=1.0)
    pending = [c._pending[(0, q.name)] for q in grads]
    assert [p.uniform for p in pending] == [c.cached_request(i) for i in ids]
    assert all(p.uniform is c.cached_request(i) for p, i in zip(pending, ids))
    c.submit_host(tuple(range(n - per_host, n)), ids, now=1.0)
    assert c.take_responses() == [("run", ALLREDUCE, 0, ("g0", "g1"), None)]
    # a request that differs from the cached one still fails the collective, naming it
    c.submit(0, [ar("g0", shape=(5,))], now=2.0)
    for r in range(1, n):
        c.submit(r, [], now=2.0, cache_ids=ids[:1])
    [(tag, _, names, message, why, _)] = c.take_responses()
    assert (tag, names, why) == ("error", ("g0",), "mismatch") and "(5,)" in message


def test_hosts_and_single_ranks_mix_in_one_collective():
    """A host's ranks submitted together (one message from its leader) count as each rank's
    own submission would: in who is missing, in the offer, and towards completion; a rank
    that repeats its submission is still one rank."""
    c = Coordinator(10)
    grads = [ar("g0"), ar("g1")]
    ids = _cached(c, grads, 10)
    c.submit_host((2, 3, 4), ids, now=1.0)
    c.submit(1, [], now=1.0, cache_ids=ids)
    c.submit_host((5, 6, 7, 8), ids, now=1.0)
    c.submit(1, [], now=2.0, cache_ids=ids[:1])          # again: not a tenth rank
    assert c.take_responses() == []
    assert c.stalled_collectives(10.0, 5.0) == [
        ("g0", [1, 2, 3, 4, 5, 6, 7, 8], [0, 9]), ("g1", [1, 2, 3, 4, 5, 6, 7, 8], [0, 9])]
    c.submit(0, [ar("g0"), ar("g1")], now=3.0)            # in full: equal, not the cached objects
    rank, offered, answer = c.offer()
    assert (rank, offered) == (9, tuple(ids))
    c.submit(9, [], now=3.0, cache_ids=ids)
    assert c.take_responses() == list(answer) == [("run", ALLREDUCE, 0, ("g0", "g1"), None)]
    c.submit_host((2, 3, 4), ids[:1], now=4.0)
    c.depart(9)                                           # g0 can no longer complete
    [(tag, _, names, message, why, _)] = c.take_responses()
    assert (tag, names, why) == ("error", ("g0",), "shutdown") and "9" in message
