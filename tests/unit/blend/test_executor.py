"""CacheBlendImpl: token selection, KV blending, RoPE correction, index helpers, seed semantics."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lmcache.blend.executor import (
    CacheBlendImpl,
    create_index,
    indices_to_mask,
    mask_to_indices,
    select_top_deviation,
)
from lmcache.blend.interfaces import PositionalEncoder

Q_HIDDEN, KV_HIDDEN = 32, 16


def make_inputs(num_tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "retrieved_k": torch.randn(num_tokens, KV_HIDDEN, generator=g),
        "retrieved_v": torch.randn(num_tokens, KV_HIDDEN, generator=g),
        "fresh_q": torch.randn(num_tokens, Q_HIDDEN, generator=g),
        "fresh_v": torch.randn(num_tokens, KV_HIDDEN, generator=g),
    }


def call(ex: CacheBlendImpl, layer: int, rk: torch.Tensor | None, rv: torch.Tensor | None,
         q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
         valid: torch.Tensor | None = None, original: torch.Tensor | None = None,
         qsl: torch.Tensor | None = None, token_dim: int = 0):  # type: ignore[no-untyped-def]
    n = rk.shape[token_dim] if rk is not None else q.shape[token_dim]
    return ex.blend(layer, rk, rv,
                    valid if valid is not None else torch.ones(n, dtype=torch.bool),
                    original if original is not None else torch.arange(n),
                    q, k, v, positions, qsl if qsl is not None else torch.tensor([0, n]), token_dim)


# ---- index helpers ------------------------------------------------------------------------------


def test_create_index_applies_the_index_on_the_target_dim_only() -> None:
    t = torch.arange(24).view(2, 3, 4)
    idx = torch.tensor([0, 2])
    assert torch.equal(t[create_index(3, 1, idx)], t[:, idx, :])
    assert torch.equal(t[create_index(3, -1, idx)], t[..., idx])


def test_create_index_rejects_a_dim_outside_the_tensor() -> None:
    with pytest.raises(ValueError, match="target_dim=3"):
        create_index(3, 3, torch.tensor([0]))


@given(st.lists(st.booleans(), min_size=0, max_size=64))
def test_mask_to_indices_and_indices_to_mask_round_trip(bits: list[bool]) -> None:
    mask = torch.tensor(bits, dtype=torch.bool)
    idx = mask_to_indices(mask)
    assert idx.dtype == torch.int64
    assert idx.tolist() == [i for i, b in enumerate(bits) if b]
    assert torch.equal(indices_to_mask(idx, len(bits)), mask)


def test_indices_to_mask_rejects_indices_outside_the_size() -> None:
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        indices_to_mask(torch.tensor([1, 4]), 4)


def test_mask_to_indices_requires_a_1d_bool_mask() -> None:
    with pytest.raises(ValueError, match="1-D bool"):
        mask_to_indices(torch.tensor([1, 0, 1]))


def test_select_top_deviation_keeps_forced_tokens_plus_the_top_fraction_of_valid_ones() -> None:
    deviation = torch.tensor([0.1, 0.0, 5.0, 3.0, 0.2, 4.0])
    forced = torch.tensor([False, True, False, False, False, False])
    # 5 valid tokens * 0.4 = 2 kept by deviation (2 and 5), plus the forced token 1
    assert select_top_deviation(deviation, forced, 5, 0.4).tolist() == [1, 2, 5]
    assert select_top_deviation(deviation, forced, 5, 0.0).tolist() == [1]
    assert select_top_deviation(deviation, forced, 5, 1.0).tolist() == [0, 1, 2, 3, 4, 5]


# ---- selection and blending ---------------------------------------------------------------------


def test_layers_before_the_check_layer_compute_every_token_with_fresh_kv() -> None:
    x = make_inputs(10)
    k = torch.randn(10, KV_HIDDEN)
    out = call(CacheBlendImpl(0.2), 0, x["retrieved_k"], x["retrieved_v"], x["fresh_q"], k, x["fresh_v"],
               torch.arange(10))
    assert out.q is x["fresh_q"] and out.k is k and out.v is x["fresh_v"]
    assert out.local_indices.tolist() == list(range(10)) and out.query_start_loc is None


def test_check_layer_keeps_invalid_tokens_and_the_most_deviating_fraction() -> None:
    x = make_inputs(20)
    fresh_k = x["retrieved_k"].clone()
    for token, delta in ((3, 5.0), (7, 3.0), (12, 4.0), (15, 9.0)):
        fresh_k[token] += delta
    valid = torch.ones(20, dtype=torch.bool)
    valid[15] = False  # no usable KV: always recomputed, whatever its deviation
    ex = CacheBlendImpl(3 / 19)  # ceil(3/19 * 19 valid tokens) = 3 chosen by deviation
    out = call(ex, 1, x["retrieved_k"], x["retrieved_v"], x["fresh_q"], fresh_k, x["fresh_v"],
               torch.arange(20), valid=valid)
    assert out.local_indices.tolist() == [3, 7, 12, 15]
    assert out.positions.tolist() == [3, 7, 12, 15]
    assert torch.equal(out.q, x["fresh_q"][[3, 7, 12, 15]])
    assert torch.equal(out.k, fresh_k) and torch.equal(out.v, x["fresh_v"])  # all computed here
    assert out.query_start_loc is not None and out.query_start_loc.tolist() == [0, 4]
    assert ex.selected_indices is not None and ex.selected_indices.tolist() == [3, 7, 12, 15]


def test_later_layers_take_the_short_q_and_blend_fresh_kv_into_the_retrieved_kv() -> None:
    x = make_inputs(12)
    fresh_k = x["retrieved_k"].clone()
    fresh_k[[2, 9]] += 10.0
    ex = CacheBlendImpl(2 / 12)
    call(ex, 1, x["retrieved_k"], x["retrieved_v"], x["fresh_q"], fresh_k, x["fresh_v"], torch.arange(12))
    # layer 2: the caller now computes only tokens 2 and 9
    y = make_inputs(12, seed=1)
    q2, k2, v2 = torch.randn(2, Q_HIDDEN), torch.randn(2, KV_HIDDEN), torch.randn(2, KV_HIDDEN)
    out = call(ex, 2, y["retrieved_k"], y["retrieved_v"], q2, k2, v2, torch.tensor([2, 9]))
    expected_k, expected_v = y["retrieved_k"].clone(), y["retrieved_v"].clone()
    expected_k[[2, 9]], expected_v[[2, 9]] = k2, v2
    assert torch.equal(out.q, q2) and out.positions.tolist() == [2, 9]
    assert torch.equal(out.k, expected_k) and torch.equal(out.v, expected_v)
    assert out.local_indices.tolist() == [0, 1] and out.query_start_loc is None


def test_blend_never_modifies_its_inputs() -> None:
    x = make_inputs(8)
    fresh_k = torch.randn(8, KV_HIDDEN)
    ex = CacheBlendImpl(0.25)
    snapshot = {k: v.clone() for k, v in x.items()}
    out = call(ex, 1, x["retrieved_k"], x["retrieved_v"], x["fresh_q"], fresh_k, x["fresh_v"],
               torch.arange(8))
    n = out.q.shape[0]
    call(ex, 2, x["retrieved_k"], x["retrieved_v"], torch.randn(n, Q_HIDDEN), torch.randn(n, KV_HIDDEN),
         torch.randn(n, KV_HIDDEN), out.positions)
    assert all(torch.equal(x[k], snapshot[k]) for k in x)


@pytest.mark.parametrize(("ratio", "expected"), [(0.0, [4]), (1.0, list(range(8)))])
def test_ratio_zero_recomputes_only_invalid_tokens_and_ratio_one_everything(ratio: float,
                                                                            expected: list[int]) -> None:
    x = make_inputs(8)
    valid = torch.ones(8, dtype=torch.bool)
    valid[4] = False
    out = call(CacheBlendImpl(ratio), 1, x["retrieved_k"], x["retrieved_v"], x["fresh_q"],
               torch.randn(8, KV_HIDDEN), x["fresh_v"], torch.arange(8), valid=valid)
    assert out.local_indices.tolist() == expected


def test_selection_is_per_request_and_query_start_loc_counts_the_selected_tokens() -> None:
    x = make_inputs(20)
    fresh_k = x["retrieved_k"].clone()
    fresh_k[[1, 5]] += 1.0  # request 0: small deviations
    fresh_k[[9, 14, 19, 10]] += torch.tensor([9.0, 8.0, 7.0, 6.0]).unsqueeze(1)  # request 1: large
    qsl = torch.tensor([0, 8, 20])
    out = call(CacheBlendImpl(0.25), 1, x["retrieved_k"], x["retrieved_v"], x["fresh_q"], fresh_k,
               x["fresh_v"], torch.arange(20), qsl=qsl)
    # request 0: ceil(0.25 * 8) = 2 tokens; request 1: ceil(0.25 * 12) = 3 tokens
    assert out.local_indices.tolist() == [1, 5, 9, 14, 19]
    assert out.query_start_loc is not None and out.query_start_loc.tolist() == [0, 2, 5]
    assert qsl.tolist() == [0, 8, 20]  # the caller's query_start_loc is left as it was


def test_several_check_layers_filter_gradually_down_to_the_ratio() -> None:
    x = make_inputs(16)
    ex = CacheBlendImpl(0.25, check_layers=[1, 3])
    fresh_k = x["retrieved_k"] + torch.arange(16.0).unsqueeze(1)  # deviation grows with the index
    out1 = call(ex, 1, x["retrieved_k"], x["retrieved_v"], x["fresh_q"], fresh_k, x["fresh_v"],
                torch.arange(16))
    assert out1.local_indices.tolist() == list(range(8, 16))  # ceil(0.25 ** 0.5 * 16) = 8
    kept = out1.positions
    out2 = call(ex, 2, x["retrieved_k"], x["retrieved_v"], out1.q, fresh_k[kept], x["fresh_v"][kept], kept)
    assert out2.query_start_loc is None
    # layer 3: fresh K now deviates most for the *first* kept tokens
    k3 = x["retrieved_k"][kept] + torch.arange(8.0, 0.0, -1.0).unsqueeze(1)
    out3 = call(ex, 3, x["retrieved_k"], x["retrieved_v"], out1.q, k3, x["fresh_v"][kept], kept)
    assert out3.positions.tolist() == [8, 9, 10, 11]  # ceil(0.25 * 16) = 4
    assert out3.local_indices.tolist() == [0, 1, 2, 3]


def test_a_token_dim_other_than_zero_is_honoured() -> None:
    x = make_inputs(10)
    fresh_k = x["retrieved_k"].clone()
    fresh_k[[0, 6]] += 3.0
    b = {k: v.unsqueeze(0) for k, v in x.items()}  # [1, T, hidden], token_dim=1
    out = call(CacheBlendImpl(0.2), 1, b["retrieved_k"], b["retrieved_v"], b["fresh_q"],
               fresh_k.unsqueeze(0), b["fresh_v"], torch.arange(10), token_dim=1)
    assert out.local_indices.tolist() == [0, 6]
    assert out.q.shape == (1, 2, Q_HIDDEN)


def test_a_call_at_or_before_the_check_layer_starts_a_new_input() -> None:
    ex = CacheBlendImpl(0.1)
    x = make_inputs(10)
    call(ex, 1, x["retrieved_k"], x["retrieved_v"], x["fresh_q"], torch.randn(10, KV_HIDDEN),
         x["fresh_v"], torch.arange(10))
    y = make_inputs(6)
    out = call(ex, 0, y["retrieved_k"], y["retrieved_v"], y["fresh_q"], torch.randn(6, KV_HIDDEN),
               y["fresh_v"], torch.arange(6))
    assert out.q.shape[0] == 6 and ex.selected_indices is None


def test_missing_retrieved_kv_means_plain_prefill_until_a_selection_happened() -> None:
    ex = CacheBlendImpl(0.5)
    x = make_inputs(6)
    k = torch.randn(6, KV_HIDDEN)
    out = call(ex, 1, None, None, x["fresh_q"], k, x["fresh_v"], torch.arange(6))
    assert out.k is k and out.q.shape[0] == 6
    call(ex, 1, x["retrieved_k"], x["retrieved_v"], x["fresh_q"], k, x["fresh_v"], torch.arange(6))
    with pytest.raises(ValueError, match="missing after tokens were selected"):
        call(ex, 2, None, None, torch.randn(3, Q_HIDDEN), torch.randn(3, KV_HIDDEN),
             torch.randn(3, KV_HIDDEN), torch.tensor([0, 1, 2]))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"valid": torch.ones(8, dtype=torch.int64)}, "CPU bool"),
    ({"original": torch.arange(7)}, "original_positions"),
    ({"qsl": torch.tensor([0, 5])}, "query_start_loc"),
])
def test_bad_arguments_raise_value_errors(kwargs: dict[str, torch.Tensor], match: str) -> None:
    x = make_inputs(8)
    with pytest.raises(ValueError, match=match):
        call(CacheBlendImpl(0.5), 1, x["retrieved_k"], x["retrieved_v"], x["fresh_q"],
             torch.randn(8, KV_HIDDEN), x["fresh_v"], torch.arange(8), **kwargs)


@pytest.mark.parametrize(("token_dim", "positions", "match"), [
    (2, torch.arange(8), "token_dim=2"),
    (-3, torch.arange(8), "token_dim=-3"),
    (0, torch.arange(8).view(2, 4), "positions"),
])
def test_a_token_dim_outside_the_tensors_or_2d_positions_raise_value_errors(
        token_dim: int, positions: torch.Tensor, match: str) -> None:
    x = make_inputs(8)
    with pytest.raises(ValueError, match=match):
        CacheBlendImpl(0.5).blend(1, x["retrieved_k"], x["retrieved_v"], torch.ones(8, dtype=torch.bool),
                                  torch.arange(8), x["fresh_q"], torch.randn(8, KV_HIDDEN), x["fresh_v"],
                                  positions, torch.tensor([0, 8]), token_dim)


def test_retrieved_kv_of_the_wrong_length_is_rejected() -> None:
    x = make_inputs(8)
    with pytest.raises(ValueError, match="do not match the 8 input tokens"):
        call(CacheBlendImpl(0.5), 1, x["retrieved_k"][:7], x["retrieved_v"][:7], x["fresh_q"],
             torch.randn(8, KV_HIDDEN), x["fresh_v"], torch.arange(8))


def test_constructor_validates_ratio_and_check_layers() -> None:
    with pytest.raises(ValueError, match="recompute_ratio"):
        CacheBlendImpl(1.5)
    with pytest.raises(ValueError, match="check_layers"):
        CacheBlendImpl(0.1, check_layers=[])


# ---- RoPE correction ----------------------------------------------------------------------------


def test_rope_encoders_round_trip_with_the_real_rotary_functions(
        rope: tuple[PositionalEncoder, PositionalEncoder]) -> None:
    encode, reverse = rope
    positions = torch.tensor([0, 5, 17, 300, 4095])
    q, k = torch.randn(5, Q_HIDDEN), torch.randn(5, KV_HIDDEN)
    q_enc, k_enc = encode(positions, q, k)
    assert not torch.allclose(k_enc[1:], k[1:])  # position 0 is the identity rotation
    q_back, k_back = reverse(positions, q_enc, k_enc)
    torch.testing.assert_close(q_back, q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_back, k, atol=1e-5, rtol=1e-5)
    _, k_only = encode(positions, q[:, :0], k)  # zero-width q: only keys are moved
    torch.testing.assert_close(k_only, k_enc)


def test_retrieved_keys_are_moved_from_their_original_positions_to_the_new_ones(
        rope: tuple[PositionalEncoder, PositionalEncoder]) -> None:
    encode, reverse = rope
    raw = torch.randn(12, KV_HIDDEN)  # keys before RoPE
    original = torch.arange(12) % 4  # e.g. three 4-token segments, each computed from position 0
    new = torch.arange(12)
    _, retrieved_k = encode(original, raw[:, :0], raw)
    _, fresh_k = encode(new, raw[:, :0], raw)
    ex = CacheBlendImpl(0.0)
    ex.set_positional_encoder(encode)
    ex.set_reverse_positional_encoder(reverse)
    valid = torch.ones(12, dtype=torch.bool)
    valid[11] = False
    x = make_inputs(12)
    out = call(ex, 1, retrieved_k, x["retrieved_v"], x["fresh_q"], fresh_k, x["fresh_v"], new,
               valid=valid, original=original)
    assert out.local_indices.tolist() == [11]  # once moved, no valid key deviates
    later = call(ex, 2, retrieved_k, x["retrieved_v"], out.q, fresh_k[11:], x["fresh_v"][11:],
                 out.positions, valid=valid, original=original)
    torch.testing.assert_close(later.k, fresh_k, atol=1e-5, rtol=1e-5)


def test_setting_only_one_positional_encoder_is_an_error(
        rope: tuple[PositionalEncoder, PositionalEncoder]) -> None:
    ex = CacheBlendImpl(0.5)
    ex.set_positional_encoder(rope[0])
    x = make_inputs(4)
    with pytest.raises(ValueError, match="both"):
        call(ex, 1, x["retrieved_k"], x["retrieved_v"], x["fresh_q"], torch.randn(4, KV_HIDDEN),
             x["fresh_v"], torch.arange(4))
