"""Runs of an elastic job's discovery script (hora.runner.discovery): each run is bounded,
and neither it nor a child it started outlives its timeout, its answer or the poller."""
import sys
import time
import uuid

import pytest

from hora.errors import HoraError
from hora.runner.discovery import Discovery
from hora.runner.hosts import HostSpec
from tests.helpers import alive_with, survivors

A2 = [HostSpec("a", 2)]


def _script(tmp_path, body):
    """A discovery script whose sleeping child carries a marker in its command line; returns
    (path, marker).  ``body`` may use {hosts}, {flag} and {child} (the sleeping child)."""
    marker = f"hora-discovery-{uuid.uuid4().hex}"
    child = f"{sys.executable} -c 'import time; time.sleep(1000)' {marker}"
    path = tmp_path / "discover.sh"
    path.write_text("#!/bin/sh\n" + body.format(hosts=tmp_path / "hosts",
                                                flag=tmp_path / "hang", child=child))
    path.chmod(0o755)
    (tmp_path / "hosts").write_text("a:2\n")
    return str(path), marker


@pytest.mark.timeout(30)
def test_a_hung_run_is_killed_with_its_children_and_the_hosts_kept(tmp_path, caplog):
    script, marker = _script(tmp_path, "[ -e {flag} ] && {child}\ncat {hosts}\n")
    discovery = Discovery(script, 1, timeout_s=1.0)
    assert discovery.poll() == A2
    (tmp_path / "hang").touch()
    started = time.monotonic()
    assert discovery.poll() == A2
    assert 1.0 <= time.monotonic() - started < 5
    assert "did not finish within 1 s; killed; keeping the hosts found before" in caplog.text
    assert survivors(marker, 2.0) == []


@pytest.mark.timeout(30)
def test_the_first_run_hung_is_fatal_and_leaves_nothing(tmp_path):
    script, marker = _script(tmp_path, "{child}\n")
    with pytest.raises(HoraError, match="did not finish within 0.5 s"):
        Discovery(script, 1, timeout_s=0.5).poll()
    assert survivors(marker, 2.0) == []


@pytest.mark.timeout(30)
def test_a_child_left_holding_the_output_neither_delays_the_answer_nor_outlives_it(tmp_path):
    script, marker = _script(tmp_path, "{child} &\ncat {hosts}\n")
    started = time.monotonic()
    assert Discovery(script, 1, timeout_s=10.0).poll() == A2
    assert time.monotonic() - started < 5
    assert survivors(marker, 2.0) == []


@pytest.mark.timeout(30)
def test_collect_does_not_wait_and_close_kills_the_run_in_flight(tmp_path):
    script, marker = _script(tmp_path, "{child}\ncat {hosts}\n")
    discovery = Discovery(script, 1, timeout_s=60.0)
    discovery.start()
    started = time.monotonic()
    while not alive_with(marker) and time.monotonic() - started < 10:
        assert discovery.collect() is None and discovery.running
        time.sleep(0.05)
    assert alive_with(marker), "the script's child never started"
    discovery.close()
    assert not discovery.running
    assert survivors(marker, 2.0) == []


def test_the_bound_on_a_run_comes_from_hora_discovery_timeout(monkeypatch):
    """Unset, a run may take 10 s; HORA_DISCOVERY_TIMEOUT sets another bound (the elastic
    tests use 2 s so that a hung run times out without a 10 s wait); a bound that is not
    seconds above 0 is refused when the launcher makes its Discovery."""
    monkeypatch.delenv("HORA_DISCOVERY_TIMEOUT", raising=False)
    assert Discovery("true", 1).timeout_s == 10.0
    monkeypatch.setenv("HORA_DISCOVERY_TIMEOUT", "2.5")
    assert Discovery("true", 1).timeout_s == 2.5
    assert Discovery("true", 1, timeout_s=7.0).timeout_s == 7.0
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv("HORA_DISCOVERY_TIMEOUT", bad)
        with pytest.raises(ValueError, match="HORA_DISCOVERY_TIMEOUT=.*seconds > 0"):
            Discovery("true", 1)
