"""A request's load on its instance: its uncached prompt counts in the backlog until its first token,
the request in flight until it ends; kv-aware weighs both against the cached prefix."""

from __future__ import annotations

import pytest

from lmcache.kv_events import BlockStored
from lmcache.router.policies import Instance, KVAware, Routed
from lmcache.router.watch import KVWatch


def test_the_backlog_counts_a_prompt_until_its_first_token_and_in_flight_until_the_end():
    inst = Instance("http://a")
    with inst.serving(1000) as prefilled:
        assert (inst.backlog, inst.in_flight) == (1000, 1)
        prefilled()
        prefilled()  # once only
        assert (inst.backlog, inst.in_flight) == (0, 1)
    assert (inst.backlog, inst.in_flight, inst.sent) == (0, 0, 1)
    with pytest.raises(RuntimeError), inst.serving(7):
        raise RuntimeError("the instance failed before its first token")
    assert (inst.backlog, inst.in_flight, inst.sent) == (0, 0, 2)


def test_kv_aware_keeps_a_returning_prompt_where_it_is_cached_once_the_others_prompts_are_computed():
    watch = KVWatch((), (), None)
    tokens = list(range(512))
    watch.index.apply("http://a", [BlockStored(list(range(31)), None, tokens[:496], 16, None, None, None)])
    a, b = Instance("http://a"), Instance("http://b")
    policy = KVAware(watch, request_cost=64)
    with a.serving(2000) as prefilled:  # another user's long prompt, still being computed on a
        assert policy.rank(Routed(tokens=tokens), [a, b])[0] is b
        prefilled()  # computed: only its decode goes on
        assert policy.rank(Routed(tokens=tokens), [a, b])[0] is a
