"""QuantizationSpec / CacheGenConfig validation and the model tables."""

from __future__ import annotations

import pytest

from lmcache.cachegen.config import (
    DEFAULT_KEY_BINS,
    DEFAULT_VALUE_BINS,
    CacheGenConfig,
    QuantizationSpec,
    specs_from_bins,
)
from lmcache.cachegen.tables import known_table


@pytest.mark.parametrize("start,end,bins", [(-1, 2, 8), (3, 3, 8), (4, 2, 8), (0, 2, 1),
                                            (0, 2, 5000)])
def test_quantization_spec_rejects_bad_ranges_and_bins(start: int, end: int, bins: int) -> None:
    with pytest.raises(ValueError, match="QuantizationSpec"):
        QuantizationSpec(start, end, bins)


def test_config_accepts_exact_cover_with_exclusive_end() -> None:
    cfg = CacheGenConfig(4, [QuantizationSpec(0, 1, 32), QuantizationSpec(1, 4, 16)],
                         [QuantizationSpec(0, 4, 8)])
    assert cfg.key_bins() == [32, 16, 16, 16]
    assert cfg.value_bins() == [8, 8, 8, 8]


def test_config_rejects_overlapping_layers() -> None:
    with pytest.raises(ValueError, match=r"kspecs: layers \[2\] are covered by more than one"):
        CacheGenConfig(4, [QuantizationSpec(0, 3, 32), QuantizationSpec(2, 4, 16)],
                       [QuantizationSpec(0, 4, 8)])


def test_config_rejects_missing_layers() -> None:
    with pytest.raises(ValueError, match=r"vspecs: layers \[3\] are not covered"):
        CacheGenConfig(4, [QuantizationSpec(0, 4, 32)], [QuantizationSpec(0, 3, 8)])


def test_config_rejects_specs_past_the_last_layer_and_empty_lists() -> None:
    with pytest.raises(ValueError, match="reaches past nlayers=4"):
        CacheGenConfig(4, [QuantizationSpec(0, 5, 32)], [QuantizationSpec(0, 4, 8)])
    with pytest.raises(ValueError, match="kspecs is empty"):
        CacheGenConfig(4, [], [QuantizationSpec(0, 4, 8)])
    with pytest.raises(ValueError, match="nlayers=0"):
        CacheGenConfig(0, [], [])


def test_default_gives_every_layer_the_same_bins_and_keys_more() -> None:
    cfg = CacheGenConfig.default_for_layers(10)
    keys, values = cfg.key_bins(), cfg.value_bins()
    assert keys == [DEFAULT_KEY_BINS] * 10 and values == [DEFAULT_VALUE_BINS] * 10
    assert DEFAULT_KEY_BINS > DEFAULT_VALUE_BINS
    assert CacheGenConfig.from_model_name("some/unknown-model", 10).key_bins() == keys


@pytest.mark.parametrize("nlayers", [1, 2, 3, 7, 80])
def test_default_covers_any_layer_count(nlayers: int) -> None:
    assert len(CacheGenConfig.default_for_layers(nlayers).key_bins()) == nlayers


def test_from_model_name_finds_the_fitted_table_in_paths_and_hub_ids() -> None:
    for name in ("HuggingFaceTB/SmolLM2-135M-Instruct",
                 "/root/.cache/lmcache/models/SmolLM2-135M-Instruct-abc-float32"):
        cfg = CacheGenConfig.from_model_name(name)
        table = known_table(name)
        assert table is not None
        assert cfg.key_bins() == list(table[0]) and cfg.value_bins() == list(table[1])


def test_from_model_name_falls_back_to_the_layer_count_default() -> None:
    assert CacheGenConfig.from_model_name("my-org/unknown-7b", 32) == \
        CacheGenConfig.default_for_layers(32)
    # a known name with a different layer count is not that model: use the default
    assert CacheGenConfig.from_model_name("SmolLM2-135M", 12) == CacheGenConfig.default_for_layers(12)
    with pytest.raises(ValueError, match="pass nlayers"):
        CacheGenConfig.from_model_name("my-org/unknown-7b")


def test_specs_from_bins_merges_runs_and_scaled_clamps() -> None:
    specs = specs_from_bins([8, 8, 16, 16, 16, 8])
    assert specs == [QuantizationSpec(0, 2, 8), QuantizationSpec(2, 5, 16), QuantizationSpec(5, 6, 8)]
    cfg = CacheGenConfig(6, specs, specs)
    assert cfg.scaled(0.01).key_bins() == [2] * 6
    assert cfg.scaled(2).key_bins() == [16, 16, 32, 32, 32, 16]


def test_cachegen_quality_scales_the_serializers_bins_and_is_validated(metadata) -> None:
    from lmcache.cachegen.serde import CacheGenSerializer
    from lmcache.config import LMCacheEngineConfig

    default = CacheGenSerializer(LMCacheEngineConfig.from_defaults(), metadata).cachegen_config
    finer = CacheGenSerializer(LMCacheEngineConfig.from_defaults(cachegen_quality=2.0),
                               metadata).cachegen_config
    assert finer == default.scaled(2.0)
    assert all(f > d for f, d in zip(finer.key_bins(), default.key_bins()))
    for bad in (0.1, 5.0):
        with pytest.raises(ValueError, match="cachegen_quality"):
            LMCacheEngineConfig.from_defaults(cachegen_quality=bad)
