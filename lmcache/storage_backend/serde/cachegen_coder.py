"""Entropy coding of CacheGen symbols with `constriction`'s ANS coder (shared by both ends).

Symbol groups. Channels of one (K/V, layer) pair are put into 16 classes by the spread of their
symbols (half-octave steps of mean |q|); a *group* is (pair, class) and has one frequency table
for all its symbols, shipped in the stream. Symbols are laid out channel-major with the pair's
channels sorted by class (`SymbolLayout`), so each group is one contiguous run per token block.

Cost of the tables (why this amortises the CDFs): per-(layer, channel) tables for a 256-token
chunk of SmolLM2 would cost 1-2 bits/value; here a chunk has ~300 groups with ~15 entries of 2
bytes, ~0.03 bits/value, while per-class models capture most of what per-channel models would
(keys: 2.31 vs 2.25 bits/value of entropy; one table per pair: 2.49).

The fast path (`benchmarks/cachegen_coder_speed.py`, CacheGen's own symbols of real chunks, one
thread; `constriction` holds the GIL, so threads do not help): one `Categorical` model per group,
built once per stream, and one ANS `encode_reverse` / `decode` call per group run (~300 calls
per chunk). Measured in M values/s, encode / decode: a range coder with one model per symbol
44 / 22; ANS with one model per (layer, channel) run of 256 tokens 138 / 60; one model per group
202 / 68; plus tuples 236 / 70. Decoding costs ~3 ns + ~2.4 ns per bit of log2(alphabet) per
symbol (a binary search over the CDF), so small alphabets matter more than symbol counts; the
classes keep most alphabets <= 16. *Tuples*: groups with small alphabets code k = 2-4
consecutive symbols as one symbol of the product model (joint alphabet <= 256), which mostly
speeds up the encoder. Groups whose alphabet has one symbol are not coded at all.

Each (token block, pair) is an independent ANS substream of 32-bit words, so blocks and layers
can be decoded in any order or in parallel (e.g. by worker processes or on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import constriction
import numpy as np
import torch

from lmcache.storage_backend.serde.serde import CorruptBlobError

JOINT_MAX = 256
NUM_CLASSES = 16
_Categorical = constriction.stream.model.Categorical
_AnsCoder = constriction.stream.stack.AnsCoder


def channel_classes(q: torch.Tensor) -> torch.Tensor:
    """q: [G, C, T] integral float32 -> uint8 classes [G, C] in [0, 16): half-octave bins of
    the channel's mean |q| (0 for mean |q| < ~0.1)."""
    spread = q.abs().sum(dim=2).div_(q.shape[2])
    return torch.floor(2 * torch.log2(spread + 0.25) + 4).clamp_(0, NUM_CLASSES - 1).to(torch.uint8)


def tuple_size(n: int) -> int:
    """Symbols coded per ANS symbol for an alphabet of `n` (0: constant group, not coded)."""
    if n <= 1:
        return 0
    k = 1
    while k < 4 and n ** (k + 1) <= JOINT_MAX:
        k += 1
    return k


class Group(NamedTuple):
    row_start: int  # rows (class-sorted channels) of this group within its pair
    row_end: int
    low: int  # lowest symbol value
    size: int  # alphabet size n
    freq_start: int  # offset of its table in the concatenated frequencies
    key: int  # index of the group (models are looked up by it)


@dataclass
class SymbolLayout:
    """Channel order and symbol groups of every (K/V, layer) pair, derived from the classes.

    perm [G, C] int64: each pair's channels sorted by class (stable), row r of pair g holds
    channel perm[g, r]. group_of [G, C] int64: the group of each channel (channel order).
    groups[g]: pair g's groups in increasing class order (the format's group order)."""

    perm: torch.Tensor
    group_of: torch.Tensor
    groups: list[list[Group]]

    @staticmethod
    def from_classes(classes: torch.Tensor, low: np.ndarray | None = None,
                     size: np.ndarray | None = None) -> SymbolLayout:
        """classes: [G, C] uint8 (< 16). `low`/`size`: per group in order (default 0 / 1)."""
        classes = classes.cpu().to(torch.int64)
        npairs = classes.shape[0]
        perm = torch.argsort(classes, dim=1, stable=True)
        counts = torch.zeros(npairs, NUM_CLASSES, dtype=torch.int64)
        counts.scatter_add_(1, classes, torch.ones_like(classes))
        present = counts > 0
        gid = torch.cumsum(present.reshape(-1), 0).reshape(npairs, NUM_CLASSES) - 1
        group_of = torch.gather(gid, 1, classes)
        ngroups = int(present.sum())
        lows = np.zeros(ngroups, np.int64) if low is None else np.asarray(low, np.int64)
        sizes = np.ones(ngroups, np.int64) if size is None else np.asarray(size, np.int64)
        freq_starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        row_ends = torch.cumsum(counts, 1)
        pair_idx, cls_idx = torch.nonzero(present, as_tuple=True)
        ends = row_ends[pair_idx, cls_idx].tolist()
        starts = (row_ends - counts)[pair_idx, cls_idx].tolist()
        groups: list[list[Group]] = [[] for _ in range(npairs)]
        for i, g in enumerate(pair_idx.tolist()):
            groups[g].append(Group(starts[i], ends[i], int(lows[i]), int(sizes[i]),
                                   int(freq_starts[i]), i))
        return SymbolLayout(perm, group_of, groups)

    def with_ranges(self, low: np.ndarray, size: np.ndarray) -> SymbolLayout:
        """The same layout with each group's (low, size) set (arrays in group order)."""
        starts = np.concatenate([[0], np.cumsum(size)[:-1]]).tolist()
        low_l, size_l = low.tolist(), size.tolist()
        groups = [[grp._replace(low=low_l[grp.key], size=size_l[grp.key], freq_start=starts[grp.key])
                   for grp in pair_groups] for pair_groups in self.groups]
        return SymbolLayout(self.perm, self.group_of, groups)

    def group_values(self, field: str) -> torch.Tensor:
        """A Group field of every group, in group order (int64 [ngroups])."""
        return torch.tensor([getattr(grp, field) for pair_groups in self.groups
                             for grp in pair_groups], dtype=torch.int64)

    @property
    def num_groups(self) -> int:
        return sum(len(g) for g in self.groups)

    def total_size(self) -> int:
        return sum(grp.size for pair_groups in self.groups for grp in pair_groups)


def build_models(layout: SymbolLayout, freqs: np.ndarray) -> dict[int, object]:
    """The constriction model of every coded group, keyed by `Group.key`. Tuple groups get the
    product model of the group's table (the same float64 values on both ends)."""
    models: dict[int, object] = {}
    for pair_groups in layout.groups:
        for grp in pair_groups:
            k = tuple_size(grp.size)
            if k == 0:
                continue
            p = freqs[grp.freq_start:grp.freq_start + grp.size].astype(np.float64)
            p /= p.sum()
            joint = p
            for _ in range(k - 1):
                joint = np.multiply.outer(joint, p).ravel()
            models[grp.key] = _Categorical(joint, perfect=False)
    return models


_DIGITS: dict[tuple[int, int], np.ndarray] = {}


def _digits(n: int, k: int) -> np.ndarray:
    """[n**k, k] table: the base-n digits (most significant first) of each joint symbol."""
    table = _DIGITS.get((n, k))
    if table is None:
        idx = np.arange(n ** k)
        table = np.stack([(idx // n ** (k - 1 - j)) % n for j in range(k)], axis=1).astype(np.int32)
        _DIGITS[(n, k)] = table
    return table


def encode_substream(rows: np.ndarray, pair_groups: list[Group],
                     models: dict[int, object]) -> np.ndarray:
    """rows: [C, t] int32 symbols already offset to [0, n) per row -> uint32 ANS words."""
    coder = _AnsCoder()
    for grp in reversed(pair_groups):  # ANS is a stack: encode backwards, decode forwards
        k = tuple_size(grp.size)
        if k == 0:
            continue
        run = rows[grp.row_start:grp.row_end].reshape(-1)
        if k > 1:
            pad = -len(run) % k
            if pad:
                run = np.concatenate([run, np.zeros(pad, dtype=np.int32)])
            tuples = run.reshape(-1, k)
            joint = tuples[:, 0].copy()
            for j in range(1, k):
                joint *= grp.size
                joint += tuples[:, j]
            run = joint
        coder.encode_reverse(np.ascontiguousarray(run, dtype=np.int32),
                             models[grp.key])
    return coder.get_compressed()


def decode_substream(words: np.ndarray, pair_groups: list[Group],
                     models: dict[int, object], rows: np.ndarray) -> None:
    """Decode one substream into rows ([C, t] int32, offset symbols; constant groups get 0).

    Raises CorruptBlobError when the words do not decode to exactly the expected symbols."""
    ntok = rows.shape[1]
    try:
        coder = _AnsCoder(words)
        for grp in pair_groups:
            k = tuple_size(grp.size)
            target = rows[grp.row_start:grp.row_end]
            if k == 0:
                target[...] = 0
                continue
            count = target.size
            symbols = coder.decode(models[grp.key], -(-count // k))
            if k == 1:
                target[...] = symbols.reshape(-1, ntok)
            elif count % k == 0 and target.flags.c_contiguous:
                np.take(_digits(grp.size, k), symbols, axis=0, out=target.reshape(-1, k))
            else:
                target[...] = _digits(grp.size, k)[symbols].reshape(-1)[:count].reshape(-1, ntok)
        leftover = not coder.is_empty()
    except (ValueError, AssertionError, RuntimeError, OverflowError) as e:
        raise CorruptBlobError(f"cachegen substream does not decode: {e}") from e
    if leftover:
        raise CorruptBlobError("cachegen substream has data left after its symbols (corrupt)")
