import threading

import pytest

from lmcache.backoff import Backoff
from lmcache.failures import FailureDomains
from tests.helpers.clock import ManualClock


def test_delay_doubles_up_to_the_maximum_and_resets_on_success():
    clock = ManualClock()
    b = Backoff(0.01, 0.03, clock)
    assert b.ready() and not b.failing
    assert [b.failed() for _ in range(4)] == [0.01, 0.02, 0.03, 0.03]
    assert not b.ready() and b.failing
    clock.advance(0.029)
    assert not b.ready()
    clock.advance(0.001)
    assert b.ready()
    b.succeeded()
    assert not b.failing and b.failed() == 0.01


def test_invalid_delays_are_rejected():
    with pytest.raises(ValueError):
        Backoff(0, 1)


def test_a_failing_backoff_admits_one_attempt_per_delay():
    clock = ManualClock()
    b = Backoff(1.0, 30.0, clock)
    assert b.claim_attempt() and b.claim_attempt()  # not failing: every attempt
    b.failed()
    clock.advance(1.0)
    assert b.claim_attempt()  # the attempt of this delay; the others wait for its outcome
    assert not b.claim_attempt() and not b.ready()
    clock.advance(1.0)
    assert b.claim_attempt()  # the one before hangs: one more per delay
    b.succeeded()
    assert b.claim_attempt() and b.claim_attempt()


def test_calls_into_a_failing_domain_while_its_one_attempt_hangs_are_not_made():
    clock = ManualClock()
    faults = FailureDomains(str, 1.0, 30.0, clock=clock)
    assert faults.call("store", lambda: 1 / 0, None) is None
    clock.advance(1.0)  # the delay passed: one attempt may be made
    entered, answer = threading.Event(), threading.Event()

    def no_answer_until_its_timeout() -> None:
        entered.set()
        answer.wait(10)
        raise TimeoutError("no answer")

    attempt = threading.Thread(target=faults.call, args=("store", no_answer_until_its_timeout, None))
    attempt.start()
    assert entered.wait(10)
    made = []
    assert [faults.call("store", lambda: made.append(1), "miss") for _ in range(3)] == ["miss"] * 3
    answer.set()
    attempt.join()
    assert made == [] and faults.counts("store") == {"failures": 2, "skipped": 3}
