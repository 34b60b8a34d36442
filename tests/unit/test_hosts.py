"""Host lists and rank placement (hora.runner.hosts): pure functions, no processes."""
import pytest

from hora.runner import hosts as hosts_mod
from hora.runner.hosts import (HostSpec, SlotInfo, assign_slots, is_local_host, parse_hostfile,
                               parse_hostfile_text, parse_hosts, resolve_hosts)

pytestmark = pytest.mark.timeout(30)


def test_all_is_declared():
    for name in hosts_mod.__all__:
        assert hasattr(hosts_mod, name)


@pytest.mark.parametrize("text, expected", [
    ("a:4,b:2", [HostSpec("a", 4), HostSpec("b", 2)]),
    ("a", [HostSpec("a", 1)]),
    ("a:2, b ,c:3", [HostSpec("a", 2), HostSpec("b", 1), HostSpec("c", 3)]),
    ("10.0.0.1:8", [HostSpec("10.0.0.1", 8)]),
    ("[::1]:2,[fe80::1]", [HostSpec("::1", 2), HostSpec("fe80::1", 1)]),
])
def test_parse_hosts(text, expected):
    assert parse_hosts(text) == expected


@pytest.mark.parametrize("text, message", [
    ("", "no hosts"),
    ("a:2,,b", "empty entry"),
    ("a:x", "'x'"),
    ("a:0", "got 0"),
    ("a:-1", "got -1"),
    (":3", "empty host"),
    ("a:1,a:2", "more than once"),
    ("[::1", "malformed"),
])
def test_parse_hosts_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_hosts(text)


def test_hostfile_forms(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# cluster\n\nnode1 slots=4\nnode2:2   # two GPUs\n  node3  \n"
                    "node4 slots=2 max_slots=8\n")
    assert parse_hostfile(path) == [HostSpec("node1", 4), HostSpec("node2", 2),
                                    HostSpec("node3", 1), HostSpec("node4", 2)]


@pytest.mark.parametrize("text, message", [
    ("a slots=x\n", r"hosts:1: .*'x'"),
    ("a\nb slots=0\n", r"hosts:2: .*got 0"),
    ("a:2 slots=2\n", "slots given twice"),
    ("a gpus=2\n", r"unexpected 'gpus=2'"),
    ("# nothing\n\n", "no hosts"),
    ("a\na\n", "more than once"),
])
def test_hostfile_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_hostfile_text(text, name="hosts")


def test_resolve_defaults_to_localhost():
    assert resolve_hosts(3) == [HostSpec("localhost", 3)]
    assert resolve_hosts(2, hosts="a:1,b:1") == [HostSpec("a", 1), HostSpec("b", 1)]
    assert resolve_hosts(2, hosts=[("a", 2)]) == [HostSpec("a", 2)]


def test_resolve_rejects_both(tmp_path):
    with pytest.raises(ValueError, match="not both"):
        resolve_hosts(2, hosts="a:2", hostfile=tmp_path / "h")


@pytest.mark.parametrize("np", [0, -1, 1.5, "2", True])
def test_bad_np(np):
    with pytest.raises(ValueError, match="positive integer"):
        assign_slots([HostSpec("a", 4)], np)


def test_np_exceeds_slots_quotes_numbers():
    with pytest.raises(ValueError, match=r"-np 7 exceeds the 6 slots .*a:4,b:2"):
        assign_slots(parse_hosts("a:4,b:2"), 7)


def test_single_host():
    slots = assign_slots([HostSpec("localhost", 4)], 3)
    assert slots == [SlotInfo("localhost", r, r, 3, 0, 1, 3) for r in range(3)]


def test_fills_hosts_in_order():
    slots = assign_slots(parse_hosts("a:2,b:2,c:2"), 5)
    assert [(s.hostname, s.rank, s.local_rank, s.local_size) for s in slots] == [
        ("a", 0, 0, 2), ("a", 1, 1, 2), ("b", 2, 0, 2), ("b", 3, 1, 2), ("c", 4, 0, 1)]
    assert all(s.size == 5 for s in slots)


def test_cross_rank_on_uneven_hosts():
    # a has 3 ranks, b 1, c 2: local rank 0 exists on a, b, c; 1 on a, c; 2 on a only
    slots = assign_slots(parse_hosts("a:3,b:1,c:2"), 6)
    table = {(s.hostname, s.local_rank): (s.cross_rank, s.cross_size) for s in slots}
    assert table == {
        ("a", 0): (0, 3), ("a", 1): (0, 2), ("a", 2): (0, 1),
        ("b", 0): (1, 3),
        ("c", 0): (2, 3), ("c", 1): (1, 2),
    }
    assert [s.local_size for s in slots] == [3, 3, 3, 1, 2, 2]


def test_unused_hosts_are_left_out():
    slots = assign_slots(parse_hosts("a:2,b:2"), 2)
    assert {s.hostname for s in slots} == {"a"}
    assert all(s.cross_size == 1 for s in slots)


@pytest.mark.parametrize("name", ["localhost", "127.0.0.1", "127.3.4.5", "::1", "[::1]",
                                  "LOCALHOST"])
def test_local_hosts(name):
    assert is_local_host(name)


@pytest.mark.parametrize("name", ["192.0.2.1", "203.0.113.9", "host.invalid"])
def test_remote_hosts(name):
    assert not is_local_host(name)
