"""A host leader's control plane, in process (no sockets): who connects to whom
(hora.core.links.ctrl_parents, a tree of leaders beyond HORA_CONTROL_FANOUT + 1 hosts, rank
0's host led by its next rank, groups of 8 ranks on one host of more than that many + 1
ranks), what
a leader sends rank 0 for its host's requests and those of the leaders below it
(hora.core.engine.relay.HostDesk), and that rank 0 decides the same from a host's one message
as from each rank's own (Coordinator.submit_host)."""
import numpy as np
import pytest

from hora.core.engine.relay import HostDesk
from hora.core.engine.small import SmallReductions
from hora.core.links import ctrl_children, ctrl_parent, ctrl_parents, ctrl_routes
from hora.core.messages import ALLREDUCE, JOIN, Request, Sum
from hora.core.negotiation import Coordinator
from hora.core.wire import Cache, Fwd, HostIds, Req, Bye, Run, decode, encode
from hora.errors import HoraInternalError


def ar(name, set_id=0):
    return Request(name, ALLREDUCE, "<f4", ((4,),), Sum, -1, 1.0, 1.0, None, set_id)


def test_the_control_connections_form_a_tree_of_hosts():
    one = ("a",) * 5
    assert [ctrl_parent(r, one) for r in range(5)] == [None, 0, 0, 0, 0]
    assert ctrl_children(0, one) == [1, 2, 3, 4]
    hosts = ("a", "a", "b", "b", "b", "c", "a")
    # every host's leader (its lowest rank; on rank 0's host its next one) to rank 0; the
    # rest to their leader
    assert [ctrl_parent(r, hosts) for r in range(7)] == [None, 0, 0, 2, 2, 0, 1]
    assert ctrl_children(0, hosts) == [1, 2, 5]
    assert ctrl_children(1, hosts) == [6]
    assert ctrl_children(2, hosts) == [3, 4]
    assert ctrl_children(3, hosts) == [] and ctrl_children(5, hosts) == []
    assert ctrl_parents(hosts) == [ctrl_parent(r, hosts) for r in range(7)]
    # a host of two ranks, rank 0's among them, needs no leader of its own
    assert ctrl_parents(("a", "a", "b", "b")) == [None, 0, 0, 2]


def test_rank_0_s_host_is_led_by_its_next_rank_outside_the_leaders_tree():
    hosts = tuple(r // 8 for r in range(64))            # 8 hosts of 8
    parents = ctrl_parents(hosts)
    assert ctrl_children(0, hosts) == [1, 8, 16, 24, 32, 40, 48, 56]
    assert parents[2:8] == [1] * 6 and parents[9:16] == [8] * 7
    # 6 hosts of 4 with HORA_CONTROL_FANOUT=2: leaders 4 8 below rank 0, 12 16 below 4, 20
    # below 8; rank 1 leads 2 and 3 beside them, so rank 0 holds three connections
    parents = ctrl_parents(tuple(r // 4 for r in range(24)), 2)
    assert [parents[r] for r in (1, 2, 3, 4, 8, 12, 16, 20)] == [0, 1, 1, 0, 0, 4, 4, 8]
    assert [r for r, p in enumerate(parents) if p == 0] == [1, 4, 8]
    assert all(parents[r] < r for r in range(1, 24))


def test_beyond_fanout_plus_one_hosts_the_leaders_form_a_tree():
    hosts = tuple(r // 2 for r in range(16))        # 8 hosts of 2: leaders 0 2 4 .. 14
    assert ctrl_parents(hosts, 7) == ctrl_parents(hosts)        # 8 hosts: all to rank 0
    assert ctrl_children(0, hosts, 7) == [1, 2, 4, 6, 8, 10, 12, 14]
    parents = ctrl_parents(hosts, 2)
    # leaders in host order, two below each: 2 4 | 6 8 below 2 | 10 12 below 4 | 14 below 6
    assert [parents[r] for r in range(0, 16, 2)] == [None, 0, 0, 2, 2, 4, 4, 6]
    assert [parents[r] for r in range(1, 16, 2)] == list(range(0, 16, 2))  # to their leader
    assert all(parents[r] < r for r in range(1, 16))
    assert ctrl_children(2, hosts, 2) == [3, 6, 8]
    assert ctrl_routes(2, parents) == {3: 3, 6: 6, 7: 6, 8: 8, 9: 8, 14: 6, 15: 6}
    routes = ctrl_routes(0, parents)
    assert sorted(routes) == list(range(1, 16)) and set(routes.values()) == {1, 2, 4}
    assert ctrl_parents(tuple(range(40)), 3)[1:5] == [0, 0, 0, 1]   # hosts of one rank


def test_one_host_of_more_than_fanout_plus_one_ranks_is_led_as_hosts_of_8():
    assert ctrl_parents(("a",) * 17) == [None] + [0] * 16           # 16 + 1: rank 0 leads all
    parents = ctrl_parents(("a",) * 40)
    assert parents == [None] + [0] * 7 + sum(([0] + [g] * 7 for g in (8, 16, 24, 32)), [])
    assert ctrl_children(0, ("a",) * 40) == [*range(1, 8), 8, 16, 24, 32]
    # with HORA_CONTROL_FANOUT=2, 7 ranks: groups {0, 1} {2, 3} {4, 5} {6}, leader 6 below 2
    assert ctrl_parents(("a",) * 7, 2) == [None, 0, 0, 2, 0, 4, 2]
    assert ctrl_parents(("a",) * 3, 2) == [None, 0, 0]
    # on several hosts: rank 0's host led by rank 1, as hosts are, whatever their size
    assert ctrl_parents(("a",) * 20 + ("b",) * 20)[:20] == [None, 0] + [1] * 18


def _tree_desk(hold_s=1.0):
    """Leader 2's desk: its host's rank 3, and leader 6 below it, which gathers 6, 7."""
    desk = HostDesk([2, 3], hold_s, below={6: [6, 7]})
    desk.heard([Cache(0, ar("g0")), Cache(1, ar("g1"))])
    return desk


def test_a_leader_holds_the_ids_of_the_leaders_below_it_with_its_host_s():
    desk = _tree_desk()
    assert (desk.members, desk.ranks) == ((2, 3, 6), (2, 3, 6, 7))
    x = {r: np.full(4, r + 1.0, np.float32) for r in (2, 3, 6, 7)}
    below = HostIds((6, 7), [0], {(0, "g0"): (x[6] + x[7]).tobytes()})
    assert desk.host(6, below, now=0.0) == []
    assert desk.request(3, Req([], {(0, "g0"): x[3].tobytes()}, [0], False), now=0.0) == []
    [msg] = desk.request(2, Req([], {(0, "g0"): x[2].tobytes()}, [0], False), now=0.0)
    assert (msg.ranks, msg.ids) == ((2, 3, 6, 7), [0])
    want = (x[2] + x[3]) + (x[6] + x[7])                # members in order: 2, 3, then 6's
    assert np.frombuffer(msg.small[(0, "g0")], np.float32).tobytes() == want.tobytes()
    # held past the hold: the leader below's go up as its own HostIds, a rank's as its Fwd
    desk.host(6, HostIds((6, 7), [1], {}), now=1.0)
    desk.request(3, Req([], {}, [1], False), now=1.2)
    assert desk.due(2.0) == [HostIds((6, 7), [1], {})]
    assert desk.due(2.2) == [Fwd(3, Req([], {}, [1], False))]
    assert not desk.holding()


def test_what_a_leader_below_passes_on_goes_up_as_it_came():
    desk = _tree_desk()
    desk.host(6, HostIds((6, 7), [0], {}), now=0.0)
    new = Fwd(7, Req([ar("new")], {}, [], False))
    assert desk.forwarded(6, new) == [new]              # its held ids stay held
    assert desk.holding()
    # a HostIds of some of its ranks (its own hold ran out): after its held ids
    part = HostIds((7,), [1], {})
    assert desk.host(6, part, now=0.0) == [HostIds((6, 7), [0], {}), part]
    # a goodbye below: after its held ids, and nothing is held until the job is re-formed
    desk.host(6, HostIds((6, 7), [0], {}), now=0.0)
    assert desk.forwarded(6, Fwd(7, Bye())) == [HostIds((6, 7), [0], {}), Fwd(7, Bye())]
    desk.heard([Run(JOIN, 0, ("join",), 3)])
    # a join below: nothing is held until it is over
    join = Fwd(7, Req([Request("join", JOIN, "", ((),), -1, -1, 1.0, 1.0, None)], {}, [],
                      False))
    desk.request(3, Req([], {}, [0], False), now=0.0)
    assert desk.forwarded(6, join) == [join, Fwd(3, Req([], {}, [0], False))]
    assert desk.host(6, HostIds((6, 7), [1], {}), now=0.0) == [HostIds((6, 7), [1], {})]
    # ranks that are not below that leader: refused
    with pytest.raises(HoraInternalError, match="not below it"):
        desk.host(6, HostIds((6, 9), [1], {}), now=0.0)
    with pytest.raises(HoraInternalError, match="not below it"):
        desk.host(3, HostIds((3,), [1], {}), now=0.0)


def _desk(hold_s=1.0):
    desk = HostDesk([5, 2, 3], hold_s)
    desk.heard([Cache(0, ar("g0")), Cache(1, ar("g1")), Cache(2, ar("p", set_id=1))])
    return desk


def test_a_host_s_ids_go_up_once_every_rank_of_it_submitted_them():
    desk = _desk()
    assert desk.request(3, Req([], {}, [0, 1], False), now=0.0) == []
    assert desk.request(5, Req([], {}, [0], False), now=0.0) == []
    assert desk.holding()
    assert desk.request(2, Req([], {}, [0, 1], False), now=0.0) == [HostIds((2, 3, 5), [0], {})]
    assert desk.request(5, Req([], {}, [1], False), now=0.1) == [HostIds((2, 3, 5), [1], {})]
    assert not desk.holding()
    assert (desk.sent_host, desk.sent_fwd) == (2, 0)


def test_small_inputs_go_up_as_the_host_s_partial_result_in_rank_order():
    desk = _desk()
    x = {r: np.array([r, 0.1 * r, 1e8, -1e8], np.float32) for r in (2, 3, 5)}
    for rank in (3, 5, 2):
        out = desk.request(rank, Req([], {(0, "g0"): x[rank].tobytes()}, [0], False), now=0.0)
    [msg] = out
    assert (msg.ranks, msg.ids, list(msg.small)) == ((2, 3, 5), [0], [(0, "g0")])
    want = (x[2] + x[3]) + x[5]
    assert np.frombuffer(msg.small[(0, "g0")], np.float32).tobytes() == want.tobytes()
    # a rank whose input went larger (none sent): no partial, the data plane runs it
    desk.request(2, Req([], {}, [0], False), now=0.0)
    desk.request(3, Req([], {(0, "g0"): x[3].tobytes()}, [0], False), now=0.0)
    assert desk.request(5, Req([], {}, [0], False), now=0.0) == [HostIds((2, 3, 5), [0], {})]


def test_rank_0_reduces_one_partial_a_host():
    c = Coordinator(5)
    ids = _cached(c, range(5), ["g0"])
    small = SmallReductions(c)
    x = {r: np.full(4, r + 1, np.float32) for r in range(5)}
    small.take(1, (), {(0, "g0"): x[1].tobytes()}, ids)
    small.take_host((2, 3, 4), {(0, "g0"): (x[2] + x[3] + x[4]).tobytes()}, ids)
    req = c.cached_request(ids[0])
    pending = {(0, "g0"): (req, [x[0]], None)}
    value = small.settle(Run(ALLREDUCE, 0, ("g0",)), pending)
    assert value.tag == "value"
    assert np.frombuffer(value.results[0], np.float32).tolist() == [15.0] * 4


def test_a_rank_s_held_ids_go_up_before_its_next_other_message():
    desk = _desk()
    desk.request(3, Req([], {(0, "g1"): b"x"}, [1], False), now=0.0)
    full = Req([ar("new")], {}, [], False)
    assert desk.request(3, full, now=0.0) == [Fwd(3, Req([], {(0, "g1"): b"x"}, [1], False)),
                                             Fwd(3, full)]
    # ids of another process set, and stack answers, metrics, go up as they came
    assert desk.request(2, Req([], {}, [2], False), now=0.0) == [Fwd(2, Req([], {}, [2], False))]
    assert not desk.holding()


def test_ids_held_past_the_hold_go_up_rank_by_rank():
    desk = _desk(hold_s=0.5)
    desk.request(3, Req([], {}, [0], False), now=1.0)
    desk.request(2, Req([], {}, [0, 1], False), now=1.2)
    assert desk.due(1.4) == []
    assert desk.due(1.5) == [Fwd(3, Req([], {}, [0], False))]
    assert desk.due(1.69) == []
    assert desk.due(1.7) == [Fwd(2, Req([], {}, [0, 1], False))]
    # what went up rank by rank is not counted again when the last rank comes
    assert desk.request(5, Req([], {}, [0], False), now=2.0) == []
    assert desk.due(2.5) == [Fwd(5, Req([], {}, [0], False))]


def test_while_a_rank_of_the_host_has_joined_or_left_nothing_is_held():
    desk = _desk()
    join = Req([Request("join", JOIN, "", ((),), -1, -1, 1.0, 1.0, None)], {}, [], False)
    desk.request(2, Req([], {}, [0], False), now=0.0)
    assert desk.request(3, join, now=0.0) == [Fwd(3, join), Fwd(2, Req([], {}, [0], False))]
    assert desk.request(5, Req([], {}, [1], False), now=0.0) == [Fwd(5, Req([], {}, [1], False))]
    desk.heard([Run(JOIN, 0, ("join",), 3)])            # the join is over: holding again
    assert desk.request(5, Req([], {}, [1], False), now=0.0) == []
    assert desk.other(3, Bye()) == [Fwd(3, Bye()), Fwd(5, Req([], {}, [1], False))]
    assert desk.request(2, Req([], {}, [1], False), now=0.0) == [Fwd(2, Req([], {}, [1], False))]


def test_the_leader_s_messages_travel_as_plain_tuples():
    for msg in (HostIds((2, 3), [0, 1], {(0, "g"): (b"a", b"b")}),
                Fwd(3, Req([ar("x")], {(0, "x"): b"z"}, [4], False)), Fwd(3, Bye())):
        assert decode(encode(msg)) == msg


def _cached(c, ranks, names):
    """Submit ``names`` twice from every rank: the coordinator caches them."""
    for _ in range(2):
        for r in ranks:
            c.submit(r, [ar(n) for n in names], now=0.0)
    out = c.take_responses()
    return [r.cache_id for r in out if r.tag == "cache"]


def test_rank_0_decides_the_same_from_a_host_s_one_message_as_from_each_rank():
    names = ["g0", "g1", "g2"]
    by_rank, by_host = Coordinator(6, fusion_threshold=32), Coordinator(6, fusion_threshold=32)
    ids = _cached(by_rank, range(6), names)
    assert _cached(by_host, range(6), names) == ids and len(ids) == 3
    for c in (by_rank, by_host):
        for r in (0, 1):
            c.submit(r, [], now=1.0, cache_ids=ids[::-1])
    for r in (2, 3, 4, 5):
        by_rank.submit(r, [], now=2.0, cache_ids=ids[:2])
    by_host.submit_host((2, 3), ids[:2], now=2.0)
    by_host.submit_host((4, 5), ids[:2], now=2.0)
    assert by_rank.take_responses() == by_host.take_responses() == [
        Run(ALLREDUCE, 0, ("g0", "g1"))]
    assert by_host.last_submit == by_rank.last_submit
    by_rank.submit(2, [], now=3.0, cache_ids=ids[2:])
    by_host.submit_host((2,), ids[2:], now=3.0)
    assert by_host.stalled(10.0, 5.0) == by_rank.stalled(10.0, 5.0) == {
        3: ["g2"], 4: ["g2"], 5: ["g2"]}


def test_a_request_with_new_collectives_goes_up_and_its_global_ids_are_held():
    """Other ranks' held ids of the global set must not wait for this rank's: they are held
    the same way whatever else its request carries."""
    desk = _desk()
    desk.request(2, Req([], {}, [0], False), now=0.0)
    desk.request(5, Req([], {}, [0], False), now=0.0)
    mixed = Req([ar("new")], {(0, "new"): b"n", (0, "g0"): b"g"}, [0, 2], False)
    out = desk.request(3, mixed, now=0.0)
    assert out == [Fwd(3, Req([ar("new")], {(0, "new"): b"n"}, [2], False)),
                   HostIds((2, 3, 5), [0], {})]
    assert not desk.holding()
