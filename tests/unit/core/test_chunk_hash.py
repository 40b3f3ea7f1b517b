"""`lmcache.chunk_hash`: the chain's seed of a request never stands for two requests, and token ids
that are not integers are refused rather than truncated into another prompt's digests."""

import numpy as np
import pytest

from lmcache.chunk_hash import chunk_digests, extra_key_of


@pytest.mark.parametrize("a, b", [
    (("a|lora=1", None), ("a", 1)),
    (("a|mm=img@0", None, ()), ("a", None, ["img@0"])),
    ((None, None, ["x,y"]), (None, None, ["x", "y"])),
    ((None, None, ["x|lora=1"]), (None, None, ["x", "lora=1"])),
    (("a%7Cb", None), ("a|b", None)),
])
def test_different_salts_loras_and_media_never_give_one_seed(a, b):
    assert extra_key_of(*a) != extra_key_of(*b)
    assert chunk_digests([1, 2], 2, extra_key_of(*a)) != chunk_digests([1, 2], 2, extra_key_of(*b))


def test_the_seeds_of_ordinary_requests_are_unchanged():
    assert extra_key_of() is None and extra_key_of("") is None
    assert extra_key_of("tenant-a", 3, ["img@0", "img@9"]) == "salt=tenant-a|lora=3|mm=img@0,img@9"


def test_a_salt_with_a_lone_surrogate_hashes_instead_of_raising():
    salt = extra_key_of("\ud800")  # what json.loads makes of "\ud800" in a request body
    assert chunk_digests([1, 2], 2, salt) != chunk_digests([1, 2], 2, extra_key_of("\ud801"))
    assert chunk_digests([1, 2], 2, "x") == chunk_digests([1, 2], 2, "x")


@pytest.mark.parametrize("tokens", [[1.5, 2.7], np.array([1.0, 2.0]), [True, False], np.array([1, 2], "f4")])
def test_tokens_that_are_not_integers_are_refused(tokens):
    with pytest.raises(ValueError, match="integer"):
        chunk_digests(tokens, 2)


def test_integer_tokens_of_any_width_and_no_tokens_hash():
    assert chunk_digests(np.array([1, 2], np.int32), 2) == chunk_digests([1, 2], 2)
    assert chunk_digests(np.array([1, 2], np.uint16), 2) == chunk_digests([1, 2], 2)
    assert chunk_digests([], 2) == [] and chunk_digests(np.array([], np.int64), 2) == []
