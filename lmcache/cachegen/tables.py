"""Per-model CacheGen bin tables, fitted once from real KV statistics.

How a table is fitted (`benchmarks/cachegen_calibrate.py`, on one fitting text per genre —
prose, dialogue, code, legal, German, numbers — that the quality benchmark does not use): for
each (K/V, layer) alone, quantize it coarsely (bins=6) and measure the KL divergence of the
next-token distributions, per text, normalized per text and averaged; with KL ~ w / bins**2 per
layer and rate ~ log2(bins), the allocation minimising total KL at a given rate is
``bins ∝ sqrt(w)`` (equal marginal KL per bit). The result is scaled so that the worst fitting
text lands at KL <= 0.0075 (on the ten evaluation texts: worst 0.0065 at 2.94 bits/value).

For SmolLM2-135M the keys of the middle and late layers (17-26) are the most sensitive, values
need 4-10x fewer bins than keys, and non-English text is the most sensitive genre (its summed
single-layer KL is 4-9x that of the others); layer 0 is among the least sensitive, unlike the
"early layers need more bins" rule of the CacheGen paper. The default for models without a table
(`CacheGenConfig.default_for_layers`) is therefore flat, its K / V bins the cheapest pair that
meets the same target on SmolLM2 (`cachegen_calibrate.py --layer-count-default`).
"""

from __future__ import annotations

# name fragment (lower case) -> (key bins per layer, value bins per layer)
_TABLES: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "smollm2-135m": (
        (13, 54, 25, 36, 20, 31, 27, 31, 42, 40, 57, 23, 34, 21, 47, 40, 27, 60, 74, 45, 95, 41,
         34, 96, 62, 26, 51, 22, 27, 20),
        (13, 13, 11, 9, 7, 10, 9, 12, 14, 8, 7, 6, 8, 8, 11, 8, 8, 16, 19, 9, 17, 10, 9, 23, 15, 6,
         10, 8, 8, 5),
    ),
}


def known_table(model_name: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The fitted (key bins, value bins) of the model family named in `model_name`, if any
    (matched on a name fragment, so paths and hub ids both work)."""
    name = model_name.lower().replace("_", "-")
    for fragment, table in _TABLES.items():
        if fragment in name:
            return table
    return None
