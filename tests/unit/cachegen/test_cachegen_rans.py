"""Frequency tables, symbol groups and the rANS substreams (numpy reference)."""

from __future__ import annotations

import numpy as np
import pytest

from lmcache.cachegen import rans
from lmcache.cachegen.layout import (
    NUM_CLASSES,
    CodeLayout,
    channel_classes,
    group_ids,
    group_ranges,
)
from lmcache.storage_backend.serde.serde import CorruptBlobError


def test_classes_follow_the_spread_of_symbols() -> None:
    abs_sum = np.array([[0, 2 * 50, 40 * 50]])  # mean |q| 0, 2, 40 over 50 tokens
    cls = channel_classes(abs_sum, 50)[0].tolist()
    assert cls[0] == 0 and cls[0] < cls[1] < cls[2] < NUM_CLASSES


def test_groups_are_numbered_by_pair_then_class_with_their_ranges() -> None:
    classes = np.array([[3, 0, 3, 1], [2, 2, 2, 2]], np.uint8)
    group_of, n = group_ids(classes)
    assert n == 4 and group_of.tolist() == [[2, 0, 2, 1], [3, 3, 3, 3]]
    qmin = np.array([[-1, 0, -3, 5], [0, -2, 1, 0]], np.int32)
    qmax = np.array([[4, 0, 2, 5], [1, 0, 7, 3]], np.int32)
    low, size = group_ranges(classes, qmin, qmax)
    assert low.tolist() == [0, 5, -3, -2] and size.tolist() == [1, 1, 8, 10]


def test_layout_lists_coded_channels_first_and_table_offsets() -> None:
    classes = np.array([[3, 0, 3, 1]], np.uint8)
    layout = CodeLayout.build(classes, np.array([0, 5, -3]), np.array([1, 4, 8]), np.array([0, 10]))
    assert layout.group_start.tolist() == [0, 1, 5]
    assert layout.ncoded.tolist() == [3] and layout.chans[0, :3].tolist() == [0, 2, 3]
    assert layout.nconst.tolist() == [1] and layout.cchans[0, 0] == 1
    assert layout.sym_base[0].tolist() == [8, 0, 8, -4]
    assert layout.pair_entries().tolist() == [0, 13]
    assert layout.substream_symbols().tolist() == [30]


def test_normalized_tables_sum_to_the_scale_and_keep_every_seen_symbol() -> None:
    counts = np.array([5, 0, 1000, 1, 7, 0, 0, 3])
    layout = CodeLayout.build(np.array([[0, 0, 1]], np.uint8), np.array([0, 0]), np.array([3, 5]),
                              np.array([0, 1]))
    freq = rans.normalize(counts, layout)
    assert freq[:3].sum() == rans.PROB_SCALE and freq[3:].sum() == rans.PROB_SCALE
    assert ((freq > 0) == (counts > 0)).all()
    assert freq[2] == freq[:3].max()
    assert rans.cumulative(freq, layout).tolist()[:3] == [0, int(freq[0]), int(freq[0])]
    rans.check_tables(freq, layout)
    bad = freq.copy()
    bad[0] += 1
    with pytest.raises(CorruptBlobError, match="sum to"):
        rans.check_tables(bad, layout)


def _random_substreams(seed: int, npairs: int, ntok: int, nch: int, blocks: list[int]):
    rng = np.random.default_rng(seed)
    spread = rng.choice([0, 1, 3, 40, 900], size=(npairs, nch))
    q = np.rint(rng.laplace(0, 1, (npairs, ntok, nch)) * spread[:, None, :]).astype(np.int16)
    classes = np.minimum(spread, 15).astype(np.uint8) % NUM_CLASSES
    low, size = group_ranges(classes, q.min(axis=1), q.max(axis=1))
    layout = CodeLayout.build(classes, low, size, np.concatenate([[0], np.cumsum(blocks)]))
    counts = np.bincount((q.astype(np.int64) + layout.sym_base[:, None, :]).reshape(-1),
                         minlength=layout.num_symbols)
    return q, layout, rans.normalize(counts, layout)


@pytest.mark.parametrize("ntok,blocks", [(1, [1]), (7, [3, 4]), (64, [64]), (50, [16, 16, 16, 2])])
def test_reference_substreams_roundtrip(ntok: int, blocks: list[int]) -> None:
    q, layout, freq = _random_substreams(ntok, 3, ntok, 13, blocks)
    streams = rans.encode_reference(q, layout, freq)
    lengths = np.array([s.size for s in streams])
    words = np.concatenate(streams) if lengths.sum() else np.zeros(0, np.uint32)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    out = rans.decode_reference(words, offsets, lengths, layout, freq, ntok)
    assert np.array_equal(out, q)


def test_a_substream_with_a_changed_word_or_a_missing_word_is_rejected() -> None:
    q, layout, freq = _random_substreams(1, 1, 40, 8, [40])
    (words,) = rans.encode_reference(q, layout, freq)
    flipped = words.copy()
    flipped[len(words) // 2] ^= 1 << 7
    for bad in (flipped, words[:-1]):
        with pytest.raises(CorruptBlobError, match="substream"):
            rans.decode_reference(bad, np.array([0]), np.array([len(bad)]), layout, freq, 40)
