import time

import pytest

from lmcache.backoff import Backoff


def test_delay_doubles_up_to_the_maximum_and_resets_on_success():
    b = Backoff(0.01, 0.03)
    assert b.ready() and not b.failing
    assert [b.failed() for _ in range(4)] == [0.01, 0.02, 0.03, 0.03]
    assert not b.ready() and b.failing
    time.sleep(0.035)
    assert b.ready()
    b.succeeded()
    assert not b.failing and b.failed() == 0.01


def test_invalid_delays_are_rejected():
    with pytest.raises(ValueError):
        Backoff(0, 1)
