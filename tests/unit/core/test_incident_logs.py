"""Failure and capacity logging: an incident that flaps warns at most once per interval (saying
how many it did not log), a fault raised inside a failure domain is counted where it happened and
nowhere else, and running out of room is a summary, not a warning."""

import logging

import pytest

from lmcache.failures import DomainFault, FailureDomains
from lmcache.observability import CapacityLog, IncidentLog
from tests.helpers.clock import ManualClock

log = logging.getLogger("test.incidents")


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_flapping_incident_warns_once_per_interval_with_the_count_it_did_not_log(caplog):
    clock = ManualClock()
    incidents = IncidentLog(log, "the store", interval=10.0, clock=clock)
    with caplog.at_level(logging.DEBUG, logger=log.name):
        for _ in range(50):  # fails, works, fails ... within one interval
            incidents.fail("down")
            incidents.fail("still down")
            incidents.recover()
            clock.advance(0.1)
        assert len(warnings(caplog)) == 1 and incidents.incidents == 50
        assert sum(r.getMessage().endswith("works again") and r.levelno == logging.INFO
                   for r in caplog.records) == 1  # only the announced incident's recovery is news
        clock.advance(10.0)
        incidents.fail("down again")
    last = warnings(caplog)[-1]
    assert len(warnings(caplog)) == 2 and "down again" in last and "49 more incidents" in last


def test_a_fault_is_counted_in_the_domain_it_happened_in_and_nowhere_else(caplog):
    clock = ManualClock()
    outer = FailureDomains(lambda d: f"tier {d}", 1.0, 1.0, clock=clock)
    inner = FailureDomains(lambda d: f"node {d}", 1.0, 1.0, clock=clock)

    def write() -> None:
        inner.run("n1", lambda: (_ for _ in ()).throw(ConnectionError("refused")))

    with caplog.at_level(logging.WARNING):
        with pytest.raises(DomainFault) as failed:
            outer.run("t", write)
        assert not failed.value.skipped and isinstance(failed.value.__cause__, ConnectionError)
        assert outer.call("t", write, "miss") == "miss"  # the node backs off: skipped, not tried
    assert inner.counts() == {"failures": 1, "skipped": 1}
    assert outer.counts() == {"failures": 0, "skipped": 0} and not outer.failing("t")
    assert warnings(caplog) == ["node n1 failed (treated as a cache miss): refused"]


def test_admit_counts_a_call_routed_around_a_domain_that_backs_off():
    clock = ManualClock()
    peers = FailureDomains(str, 1.0, 1.0, clock=clock)
    assert peers.admit("p") and peers.call("p", lambda: 1 / 0, None) is None
    assert not peers.admit("p") and peers.counts("p") == {"failures": 1, "skipped": 1}
    clock.advance(1.0)
    assert peers.admit("p") and peers.counts("p")["skipped"] == 1


def test_a_probe_is_made_while_backing_off_is_not_counted_and_ends_the_incident_when_it_works(caplog):
    clock = ManualClock()
    server = FailureDomains(lambda d: f"the {d}", 30.0, 30.0, clock=clock)

    def down() -> None:
        raise ConnectionError("no answer")

    with caplog.at_level(logging.WARNING):
        assert server.call("server", down, None) is None  # a request: one failure, one warning
        server.skip("server")  # its owner knows it is down: a request not made
        with pytest.raises(DomainFault):
            server.probe("server", down)  # tried although backing off; part of the incident
        assert server.counts() == {"failures": 1, "skipped": 1} and server.failing("server")
        assert server.probe("server", lambda: "attached") == "attached"  # no wait for the backoff
    assert not server.failing("server") and server.call("server", lambda: "answer", None) == "answer"
    assert warnings(caplog) == ["the server failed (treated as a cache miss): no answer"]


def test_running_out_of_room_is_summarized_at_most_once_per_interval(caplog):
    clock = ManualClock()
    full = CapacityLog(log, "the arena was full", "tokens dropped", interval=5.0, clock=clock)
    with caplog.at_level(logging.DEBUG, logger=log.name):
        for _ in range(100):
            full.note(8)
            clock.advance(0.1)  # 10 s in all
        full.note(8)
    lines = [r for r in caplog.records if r.name == log.name]
    assert all(r.levelno == logging.INFO for r in lines) and full.total == 101
    assert [r.getMessage().split(" (")[0] for r in lines] == [
        "the arena was full 1 time(s)", "the arena was full 50 time(s) in the last 5 s",
        "the arena was full 50 time(s) in the last 5 s"]
    assert "400 tokens dropped" in lines[1].getMessage()
