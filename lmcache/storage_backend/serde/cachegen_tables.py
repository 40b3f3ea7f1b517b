"""Per-model CacheGen bin tables, fitted once from real KV statistics.

How a table is fitted (`benchmarks/cachegen_calibrate.py`, on calibration text that the quality
benchmark does not use): for each (K/V, layer) alone, quantize it coarsely (bins=6) and measure
the KL divergence of the next-token distributions; with KL ~ w / bins**2 per layer and rate ~
log2(bins), the allocation minimising total KL at a given rate is ``bins ∝ sqrt(w)`` (equal
marginal KL per bit). The result is scaled so that the default setting lands near KL 0.008.

For SmolLM2-135M the keys of the middle and late layers (14-26) are the most sensitive and the
values of most layers need few bins; layer 0 is among the least sensitive, unlike the
"early layers need more bins" rule that the default for unknown models follows.
"""

from __future__ import annotations

# name fragment (lower case) -> (key bins per layer, value bins per layer)
_TABLES: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "smollm2-135m": (
        (7, 16, 18, 17, 10, 15, 16, 21, 20, 27, 12, 12, 17, 17, 26, 29, 18, 33, 30, 32, 44, 24,
         26, 51, 30, 12, 35, 18, 15, 14),
        (9, 9, 9, 5, 5, 5, 5, 7, 7, 4, 4, 3, 13, 11, 14, 18, 11, 20, 29, 15, 10, 12, 10, 15, 16,
         8, 8, 8, 9, 7),
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
