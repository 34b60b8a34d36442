"""The elastic launcher's pieces without processes: the discovery output, the blacklist's
cooldown, the settings' checks, and how a worker finds its place in a round."""
import dataclasses
import math
import random

import pytest

from hora.core import membership
from hora.core.topology import Placement
from hora.runner.elastic import (Blacklist, Discovery, ElasticSettings,
                                 parse_discovery_output)
from hora.runner.hosts import HostSpec


def test_discovery_lines_with_and_without_slots():
    text = "# hosts\nnode1:4\n\nnode2   # two slots by default\n 10.0.0.3:1 \n"
    assert parse_discovery_output(text, 2) == [HostSpec("node1", 4), HostSpec("node2", 2),
                                               HostSpec("10.0.0.3", 1)]


@pytest.mark.parametrize("text, message", [
    ("a:x\n", "slots must be a number"), ("a:0\n", "at least 1"),
    ("a\na:2\n", "listed twice"), ("a b\n", r"is not host\[:slots\]")])
def test_bad_discovery_lines_are_named(text, message):
    with pytest.raises(ValueError, match=message):
        parse_discovery_output(text, 1)


def test_first_discovery_failure_is_fatal_later_ones_keep_the_hosts(tmp_path):
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\ncat " + str(tmp_path / "list") + "\n")
    script.chmod(0o755)
    discovery = Discovery(str(script), 1, timeout_s=5)
    with pytest.raises(Exception, match="exited with code 1"):
        discovery.poll()                       # the list does not exist yet
    (tmp_path / "list").write_text("a:2\nb\n")
    assert discovery.poll() == [HostSpec("a", 2), HostSpec("b", 1)]
    (tmp_path / "list").unlink()
    assert discovery.poll() == [HostSpec("a", 2), HostSpec("b", 1)]     # kept


def test_blacklist_without_cooldown_is_for_good():
    now = [0.0]
    bl = Blacklist(None, clock=lambda: now[0])
    assert not bl.blocks("a")
    assert bl.add("a") == math.inf
    now[0] = 1e9
    assert bl.blocks("a") and not bl.blocks("b")


def test_blacklist_cooldown_doubles_with_each_failure_within_its_range():
    now = [0.0]
    rng = random.Random(7)
    bl = Blacklist((10.0, 100.0), clock=lambda: now[0], rng=random.Random(7))
    outs = [bl.add("a") for _ in range(5)]
    jitter = [rng.random() * 10 for _ in range(5)]
    want = [min(100.0, max(10.0, 10 * 2 ** i + jitter[i])) for i in range(5)]
    assert outs == pytest.approx(want)
    assert outs[-1] == 100.0
    now[0] = outs[-1] - 0.1
    assert bl.blocks("a")
    now[0] = outs[-1] + 0.1
    assert not bl.blocks("a")


@pytest.mark.parametrize("kwargs, message", [
    ({"min_np": 0}, "at least 1"), ({"min_np": 3, "max_np": 2}, "less than --min-np"),
    ({"min_np": 1, "slots": 0}, "--slots"), ({"min_np": 1, "reset_limit": -1}, "reset-limit"),
    ({"min_np": 1, "cooldown": (0.5, 2)}, "1 <= MIN <= MAX <= 3600"),
    ({"min_np": 1, "cooldown": (20, 10)}, "1 <= MIN <= MAX <= 3600"),
    ({"min_np": 1, "timeout_s": 0}, "--elastic-timeout")])
def test_elastic_settings_refuse_what_cannot_run(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ElasticSettings(**kwargs)


class _Store:
    """A RendezvousClient's answers from a dict, as the launcher's server would give them."""

    def __init__(self, items):
        self.items = dict(items)
        self.closed = False

    def put(self, key, value):
        self.items[key] = value

    def wait_prefix(self, prefix, n, timeout):
        found = {k: v for k, v in self.items.items() if k.startswith(prefix)}
        return len(found) >= n, found

    def get(self, key, timeout):
        from hora.errors import RendezvousTimeoutError
        if key not in self.items:
            raise RendezvousTimeoutError(key)
        return self.items[key]

    def close(self):
        self.closed = True


def _round(n, members, change="removed"):
    return {f"{membership.ROUND_PREFIX}{n}": membership.round_record(n, members, change,
                                                                     when=float(n)),
            membership.LATEST_KEY: n}


def test_a_worker_takes_its_rank_and_host_share_from_the_newest_round(monkeypatch):
    monkeypatch.setattr(membership, "_round", -1)
    items = {**_round(0, [("0", "a"), ("1", "a"), ("2", "b"), ("3", "b")], "start")}
    items.update(_round(1, [("0", "a"), ("2", "b"), ("3", "b")]))
    store = _Store(items)
    env = Placement(-1, 0, 0, 0, "b", "hora", "127.0.0.1", 1, secret="s", elastic_id="3")
    placed, client = membership.join_next(env, None, lambda: store)
    assert client is store and not store.closed
    assert (placed.rank, placed.size, placed.local_rank, placed.local_size, placed.hostname,
            placed.round) == (2, 3, 1, 2, "b", 1)
    assert store.items[f"{membership.READY_PREFIX}3"] == -1
    assert membership.current_round() == 1
    # nothing newer yet: no news; then a round that adds a worker
    assert membership.pending_change(store) is None
    store.items.update(_round(2, [("0", "a"), ("2", "b"), ("3", "b"), ("4", "a")], "added"))
    assert membership.pending_change(store) == {"time": 2.0, "change": "added"}
    store.items.update(_round(3, [("0", "a"), ("2", "b"), ("4", "a")], "removed"))
    assert membership.pending_change(store) == {"time": 3.0, "change": "mixed"}


def test_a_worker_left_out_of_the_newest_round_waits_for_a_later_one(monkeypatch):
    monkeypatch.setattr(membership, "_round", 0)
    monkeypatch.setenv("HORA_ELASTIC_TIMEOUT", "0.3")
    store = _Store(_round(1, [("0", "a")], "removed"))
    env = Placement(-1, 0, 0, 0, "a", "hora", "127.0.0.1", 1, secret="s", elastic_id="5")
    from hora.errors import RendezvousTimeoutError
    with pytest.raises(RendezvousTimeoutError, match="placed it in no job within 0.3 s"):
        membership.join_next(env, None, lambda: store)
    assert store.closed


def test_placement_fields_default_to_a_fixed_job():
    p = Placement(0, 1, 0, 1, "h", "single")
    assert (p.elastic_id, p.round) == (None, None)
    assert dataclasses.replace(p, round=3).round == 3
