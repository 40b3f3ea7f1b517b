"""Symbol groups, tuple coding and substreams of the constriction-based coder."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmcache.storage_backend.serde import cachegen_coder as coder
from lmcache.storage_backend.serde.serde import CorruptBlobError


@pytest.mark.parametrize("n,k", [(1, 0), (2, 4), (4, 4), (5, 3), (6, 3), (7, 2), (16, 2),
                                 (17, 1), (4095, 1)])
def test_tuple_size_keeps_joint_alphabets_small(n: int, k: int) -> None:
    assert coder.tuple_size(n) == k
    assert k <= 1 or n ** k <= coder.JOINT_MAX


def test_layout_sorts_channels_by_class_and_groups_them() -> None:
    classes = torch.tensor([[3, 0, 3, 1], [2, 2, 2, 2]], dtype=torch.uint8)
    layout = coder.SymbolLayout.from_classes(classes)
    assert layout.perm.tolist() == [[1, 3, 0, 2], [0, 1, 2, 3]]
    assert [(g.row_start, g.row_end) for g in layout.groups[0]] == [(0, 1), (1, 2), (2, 4)]
    assert [(g.row_start, g.row_end) for g in layout.groups[1]] == [(0, 4)]
    assert layout.group_of.tolist() == [[2, 0, 2, 1], [3, 3, 3, 3]]
    ranged = layout.with_ranges(np.array([-1, 0, -5, 2]), np.array([3, 1, 11, 2]))
    assert ranged.group_values("freq_start").tolist() == [0, 3, 4, 15]
    assert ranged.total_size() == 17


def test_channel_classes_follow_the_spread_of_symbols() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.zeros(1, 3, 50)
    q[0, 1] = torch.randint(-2, 3, (50,), generator=g).float()
    q[0, 2] = torch.randint(-40, 41, (50,), generator=g).float()
    cls = coder.channel_classes(q)[0].tolist()
    assert cls[0] == 0 and cls[0] < cls[1] < cls[2] < coder.NUM_CLASSES


def encode_decode(rows: np.ndarray, classes: torch.Tensor) -> np.ndarray:
    layout = coder.SymbolLayout.from_classes(classes)
    sizes = np.array([int(rows[g.row_start:g.row_end].max()) + 1 for g in layout.groups[0]])
    layout = layout.with_ranges(np.zeros(len(sizes), np.int64), sizes)
    freqs = np.concatenate([np.bincount(rows[g.row_start:g.row_end].ravel(), minlength=g.size)
                            for g in layout.groups[0]])
    models = coder.build_models(layout, freqs)
    words = coder.encode_substream(rows, layout.groups[0], models)
    out = np.full_like(rows, -1)
    coder.decode_substream(words, layout.groups[0], models, out)
    return out


@pytest.mark.parametrize("ntok", [1, 3, 7, 64])
def test_substreams_roundtrip_all_tuple_sizes_and_odd_lengths(ntok: int) -> None:
    rng = np.random.default_rng(ntok)
    sizes = [1, 2, 3, 5, 9, 40]  # k = 0, 4, 4, 3, 2, 1
    rows = np.concatenate([rng.integers(0, n, (2, ntok)) for n in sizes]).astype(np.int32)
    classes = torch.arange(len(sizes), dtype=torch.uint8).repeat_interleave(2)[None]
    assert np.array_equal(encode_decode(rows, classes), rows)


def test_a_substream_with_leftover_words_is_rejected() -> None:
    rows = np.random.default_rng(0).integers(0, 9, (4, 32)).astype(np.int32)
    layout = coder.SymbolLayout.from_classes(torch.zeros(1, 4, dtype=torch.uint8))
    layout = layout.with_ranges(np.array([0]), np.array([9]))
    models = coder.build_models(layout, np.bincount(rows.ravel(), minlength=9))
    words = coder.encode_substream(rows, layout.groups[0], models)
    with pytest.raises(CorruptBlobError, match="data left"):  # reads only half the symbols
        coder.decode_substream(words, layout.groups[0], models, np.empty((4, 16), np.int32))
