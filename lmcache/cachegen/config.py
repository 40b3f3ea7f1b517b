"""CacheGen's configuration: quantization bins per layer (seed 003 names).

`QuantizationSpec(start_layer, end_layer, bins)` gives layers ``[start_layer, end_layer)`` (end
exclusive) a number of quantization bins; `CacheGenConfig(nlayers, kspecs, vspecs)` holds one
spec list for keys and one for values, which must cover every layer exactly once.

What `bins` means here: a token's vector x_t (one layer, K or V, all ``hidden`` channels) is
quantized with the uniform step ``8 * rms(x_t) / bins`` (see `quant`), i.e. `bins` steps span
+-4 RMS of the token; values further out are still coded exactly (no clipping), so the error of
every value is at most half a step. More bins = finer steps = more bits.

`CacheGenConfig.from_model_name` returns the table fitted for a known model family (`tables`),
else `default_for_layers`: the same bins on every layer, keys more than values (on the model
measured, keys are the more sensitive and no depth rule holds).
"""

from __future__ import annotations

from dataclasses import dataclass

from lmcache.cachegen.tables import known_table

MAX_BINS = 1024
DEFAULT_KEY_BINS = 36  # the default for models without a fitted table (`default_for_layers`)
DEFAULT_VALUE_BINS = 14


@dataclass(frozen=True)
class QuantizationSpec:
    """Layers ``[start_layer, end_layer)`` use `bins` quantization bins."""

    start_layer: int
    end_layer: int
    bins: int

    def __post_init__(self) -> None:
        if self.start_layer < 0 or self.end_layer <= self.start_layer:
            raise ValueError(f"QuantizationSpec layers [{self.start_layer}, {self.end_layer}) are "
                             "empty or negative; need 0 <= start_layer < end_layer")
        if not 2 <= self.bins <= MAX_BINS:
            raise ValueError(f"QuantizationSpec bins={self.bins} must be in [2, {MAX_BINS}]")


def _check_cover(name: str, specs: list[QuantizationSpec], nlayers: int) -> None:
    if not specs:
        raise ValueError(f"{name} is empty; it must cover layers [0, {nlayers})")
    covered = [0] * nlayers
    for spec in specs:
        if spec.end_layer > nlayers:
            raise ValueError(f"{name}: {spec} reaches past nlayers={nlayers}")
        for layer in range(spec.start_layer, spec.end_layer):
            covered[layer] += 1
    twice = [i for i, c in enumerate(covered) if c > 1]
    missing = [i for i, c in enumerate(covered) if c == 0]
    if twice:
        raise ValueError(f"{name}: layers {twice} are covered by more than one spec")
    if missing:
        raise ValueError(f"{name}: layers {missing} are not covered by any spec")


def specs_from_bins(bins: list[int]) -> list[QuantizationSpec]:
    """Runs of equal per-layer bins -> the shortest spec list."""
    specs: list[QuantizationSpec] = []
    start = 0
    for layer in range(1, len(bins) + 1):
        if layer == len(bins) or bins[layer] != bins[start]:
            specs.append(QuantizationSpec(start, layer, int(bins[start])))
            start = layer
    return specs


def _bins_per_layer(specs: list[QuantizationSpec], nlayers: int) -> list[int]:
    out = [0] * nlayers
    for spec in specs:
        for layer in range(spec.start_layer, spec.end_layer):
            out[layer] = spec.bins
    return out


@dataclass
class CacheGenConfig:
    nlayers: int
    kspecs: list[QuantizationSpec]
    vspecs: list[QuantizationSpec]

    def __post_init__(self) -> None:
        if self.nlayers < 1:
            raise ValueError(f"CacheGenConfig nlayers={self.nlayers} must be >= 1")
        _check_cover("kspecs", self.kspecs, self.nlayers)
        _check_cover("vspecs", self.vspecs, self.nlayers)

    def key_bins(self) -> list[int]:
        return _bins_per_layer(self.kspecs, self.nlayers)

    def value_bins(self) -> list[int]:
        return _bins_per_layer(self.vspecs, self.nlayers)

    def scaled(self, factor: float) -> CacheGenConfig:
        """The same allocation with every layer's bins multiplied by `factor` (clamped)."""
        def scale(bins: list[int]) -> list[QuantizationSpec]:
            return specs_from_bins([min(MAX_BINS, max(2, round(b * factor))) for b in bins])
        return CacheGenConfig(self.nlayers, scale(self.key_bins()), scale(self.value_bins()))

    @staticmethod
    def uniform(nlayers: int, key_bins: int, value_bins: int) -> CacheGenConfig:
        return CacheGenConfig(nlayers, [QuantizationSpec(0, nlayers, key_bins)],
                              [QuantizationSpec(0, nlayers, value_bins)])

    @staticmethod
    def default_for_layers(nlayers: int) -> CacheGenConfig:
        """Any model without a fitted table: K bins 36 and V bins 14 on every layer (the
        cheapest such flat table that keeps SmolLM2's KL <= 0.0075 on every fitting text, the
        target of the fitted tables: `benchmarks/cachegen_calibrate.py --layer-count-default`;
        the one calibrated model does not support giving early layers more bins)."""
        if nlayers < 1:
            raise ValueError(f"nlayers={nlayers} must be >= 1")
        return CacheGenConfig.uniform(nlayers, DEFAULT_KEY_BINS, DEFAULT_VALUE_BINS)

    @staticmethod
    def from_model_name(model_name: str, nlayers: int | None = None) -> CacheGenConfig:
        """The fitted table of a known model family (when its layer count matches `nlayers`, if
        given), else `default_for_layers(nlayers)`; an unknown model needs `nlayers`."""
        table = known_table(model_name)
        if table is not None and (nlayers is None or len(table[0]) == nlayers):
            return CacheGenConfig(len(table[0]), specs_from_bins(list(table[0])),
                                  specs_from_bins(list(table[1])))
        if nlayers is None:
            raise ValueError(f"no CacheGen table for model {model_name!r}; pass nlayers to get "
                             "the default allocation")
        return CacheGenConfig.default_for_layers(nlayers)
