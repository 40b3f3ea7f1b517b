import pytest

from lmcache.backoff import Backoff
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
