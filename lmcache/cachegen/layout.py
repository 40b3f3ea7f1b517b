"""Which frequency table codes which symbol: channel classes, symbol groups and substreams.

Channels of one (K/V, layer) pair are put into 16 classes by the spread of their symbols
(half-octave steps of mean |q|); a *group* is (pair, class) and has one frequency table for all
its symbols, shipped in the stream. Per-(layer, channel) tables for a 256-token chunk of SmolLM2
would cost 1-2 bits/value; a chunk has ~300 groups of ~15 entries (~0.03 bits/value), while
per-class tables capture most of what per-channel ones would (keys: 2.31 vs 2.25 bits/value of
entropy; one table per pair: 2.49).

Groups of one pair are numbered in increasing class order, pairs in order; group n's table holds
``size[n]`` entries for the symbols ``low[n] .. low[n] + size[n] - 1``, at entries
``group_start[n] ..`` of the concatenated tables. A group with one symbol is not coded at all:
its channels decode to that symbol. A *substream* codes one (token block, pair): the symbols of
the pair's coded channels, token-major (`rans`).

All arrays are numpy, built without Python loops over groups (the decoder builds this per chunk);
this module is the definition, which the native kernels' `cg_group_ranges` / `cg_layout` follow.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NUM_CLASSES = 16
# class >= k <=> mean |q| + 1/4 >= 2 ** ((k - 4) / 2), k = 1 .. 15
CLASS_THRESHOLDS = np.exp2((np.arange(1, NUM_CLASSES) - 4) / 2)


def channel_classes(abs_sum: np.ndarray, ntok: int) -> np.ndarray:
    """abs_sum int [G, C] (sum over tokens of |q|) -> uint8 classes [G, C] in [0, 16): half-octave
    bins of the channel's mean |q|, ``min(15, max(0, floor(2 * log2(mean + 1/4) + 4)))`` (0 for
    mean |q| < ~0.1), decided by comparing with `CLASS_THRESHOLDS` (no log2, whose last bit could
    differ between numpy and the native kernels)."""
    spread = abs_sum / float(ntok) + 0.25
    return np.searchsorted(CLASS_THRESHOLDS, spread, side="right").astype(np.uint8)


def group_ids(classes: np.ndarray) -> tuple[np.ndarray, int]:
    """classes uint8 [G, C] -> (group of each channel int64 [G, C], number of groups)."""
    npairs = classes.shape[0]
    present = np.zeros((npairs, NUM_CLASSES), bool)
    present[np.arange(npairs)[:, None], classes] = True
    gid = (np.cumsum(present.reshape(-1)) - 1).reshape(npairs, NUM_CLASSES)
    return np.take_along_axis(gid, classes.astype(np.int64), axis=1), int(present.sum())


def group_ranges(classes: np.ndarray, qmin: np.ndarray, qmax: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel symbol bounds [G, C] -> each group's (low int32 [N], size int64 [N])."""
    order = np.argsort(classes, axis=1, kind="stable")  # channels of each group adjacent
    keys = np.take_along_axis(classes, order, axis=1).astype(np.int64)
    keys += (np.arange(classes.shape[0]) * NUM_CLASSES)[:, None]
    flat = keys.reshape(-1)
    starts = np.flatnonzero(np.r_[True, flat[1:] != flat[:-1]])
    low = np.minimum.reduceat(np.take_along_axis(qmin, order, axis=1).reshape(-1), starts)
    high = np.maximum.reduceat(np.take_along_axis(qmax, order, axis=1).reshape(-1), starts)
    return low.astype(np.int32), high.astype(np.int64) - low + 1


@dataclass
class CodeLayout:
    """Everything both coders need to walk a stream's substreams (int64 unless noted).

    block_starts [B + 1]: token block boundaries. group_of [G, C]: each channel's group.
    group_low int32 [N], group_size [N], group_start [N]: symbol range and table offset per group.
    ncoded [G] / chans [G, C]: each pair's coded channels first, in channel order; nconst [G] /
    cchans [G, C]: its single-symbol channels first. sym_base [G, C]: table entry of symbol 0 for
    the channel's group (``group_start - group_low``)."""

    block_starts: np.ndarray
    group_of: np.ndarray
    group_low: np.ndarray
    group_size: np.ndarray
    group_start: np.ndarray
    ncoded: np.ndarray
    chans: np.ndarray
    nconst: np.ndarray
    cchans: np.ndarray
    sym_base: np.ndarray

    @staticmethod
    def build(classes: np.ndarray, low: np.ndarray, size: np.ndarray,
              block_starts: np.ndarray) -> CodeLayout:
        """classes uint8 [G, C]; low / size per group (in group order); block_starts [B + 1]."""
        group_of, ngroups = group_ids(classes)
        if ngroups != len(low) or ngroups != len(size):
            raise ValueError(f"{len(low)} symbol ranges for {ngroups} groups")
        size = np.ascontiguousarray(size, np.int64)
        low = np.ascontiguousarray(low, np.int32)
        start = np.concatenate([[0], np.cumsum(size)[:-1]]).astype(np.int64)
        coded = size[group_of] > 1
        if coded.all():  # the usual case: both channel lists are each pair's channels in order
            chans = np.broadcast_to(np.arange(coded.shape[1], dtype=np.int64), coded.shape).copy()
            cchans = chans
        else:
            chans = np.argsort(~coded, axis=1, kind="stable").astype(np.int64)
            cchans = np.argsort(coded, axis=1, kind="stable").astype(np.int64)
        return CodeLayout(
            block_starts=np.asarray(block_starts, np.int64), group_of=group_of, group_low=low,
            group_size=size, group_start=start,
            ncoded=coded.sum(axis=1).astype(np.int64),
            chans=chans,
            nconst=(~coded).sum(axis=1).astype(np.int64),
            cchans=cchans,
            sym_base=(start - low)[group_of].astype(np.int64),
        )

    @property
    def num_pairs(self) -> int:
        return self.group_of.shape[0]

    @property
    def num_blocks(self) -> int:
        return len(self.block_starts) - 1

    @property
    def num_symbols(self) -> int:
        """Entries of all groups' tables together."""
        return int(self.group_size.sum())

    def pair_entries(self) -> np.ndarray:
        """Table entries of each pair: pair g's groups hold entries [out[g], out[g + 1])."""
        groups_per_pair = (np.diff(np.r_[-1, self.group_of.max(axis=1)]))
        first = np.r_[0, np.cumsum(groups_per_pair)]
        ends = np.r_[self.group_start, self.num_symbols]
        return ends[first].astype(np.int64)

    def substream_symbols(self) -> np.ndarray:
        """Symbols coded by each substream s = b * G + g: int64 [B * G]."""
        tokens = np.diff(self.block_starts)
        return (tokens[:, None] * self.ncoded[None, :]).reshape(-1)
