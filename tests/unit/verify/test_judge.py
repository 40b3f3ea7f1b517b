"""`lmcache.verify.judge`: equal within the tolerance, a near tie within it, a mismatch beyond it."""

import math

from lmcache.verify.judge import EQUAL, MISMATCH, TIE, judge
from lmcache.verify.openai_client import Completion

TOL = 0.01


def answer(steps: list[dict[int, float]]) -> Completion:
    """A greedy answer whose step i picks the best token of `steps[i]` (its top logprobs)."""
    chosen = [max(top, key=top.__getitem__) for top in steps]
    return Completion(chosen, [top[t] for t, top in zip(chosen, steps)], steps, 10, 0)


def test_same_tokens_within_the_tolerance_are_equal():
    j = judge(answer([{1: -0.5, 2: -1.5}, {3: -0.1}]), answer([{1: -0.505, 2: -1.5}, {3: -0.1}]), TOL)
    assert (j.verdict, j.tokens_equal, j.first_difference) == (EQUAL, True, None)
    assert math.isclose(j.max_logprob_diff, 0.005)


def test_same_tokens_beyond_the_tolerance_are_a_mismatch():
    j = judge(answer([{1: -0.5}, {3: -0.1}]), answer([{1: -0.5}, {3: -0.3}]), TOL)
    assert (j.verdict, j.tokens_equal) == (MISMATCH, True)
    assert math.isclose(j.max_logprob_diff, 0.2)


def test_a_token_flipped_by_a_near_tie_within_rounding_is_a_tie_and_ends_the_comparison():
    cached = answer([{1: -0.5}, {7: -0.690, 8: -0.695}, {9: -0.1}])
    fresh = answer([{1: -0.5}, {7: -0.697, 8: -0.693}, {5: -3.0}])  # rounding flipped 7 and 8
    j = judge(cached, fresh, TOL)
    assert (j.verdict, j.first_difference, j.tokens_equal) == (TIE, 1, False)
    assert j.max_logprob_diff <= TOL


def test_a_different_token_beyond_the_tolerance_is_a_mismatch():
    j = judge(answer([{7: -0.1, 8: -2.5}]), answer([{8: -0.2, 7: -1.9}]), TOL)
    assert (j.verdict, j.first_difference) == (MISMATCH, 0)


def test_a_token_missing_from_the_other_answers_top_logprobs_is_a_mismatch():
    j = judge(answer([{7: -0.1, 8: -2.5}]), answer([{8: -0.2, 9: -1.9}]), TOL)
    assert j.verdict == MISMATCH and j.max_logprob_diff == math.inf


def test_a_tie_after_a_step_beyond_the_tolerance_is_still_a_mismatch():
    cached = answer([{1: -0.5}, {7: -0.690, 8: -0.695}])
    fresh = answer([{1: -0.9}, {7: -0.697, 8: -0.693}])
    assert judge(cached, fresh, TOL).verdict == MISMATCH


def test_nan_logprobs_are_a_mismatch_whether_the_tokens_agree_or_not():
    nan = math.nan
    same = judge(answer([{1: nan}]), answer([{1: -0.5}]), TOL)
    assert same.verdict == MISMATCH and same.max_logprob_diff == math.inf
    flipped = judge(answer([{2: nan, 1: nan}]), answer([{1: -0.5, 2: -0.6}]), TOL)
    assert flipped.verdict == MISMATCH  # not a near tie
