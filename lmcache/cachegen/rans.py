"""CacheGen's entropy coder: interleaved rANS over per-group frequency tables (numpy reference).

Tables. Each group's symbol counts are scaled to frequencies summing to ``PROB_SCALE = 2**12``
(`normalize`): a symbol that occurs gets >= 1, one that never occurs 0 (it is never coded). 12
bits cost ~0.0003 bits/value over exact probabilities on real KV symbols.

Substreams. Substream s = b * G + g codes the symbols of token block b, pair g, token-major over
the pair's coded channels (`layout.CodeLayout`); symbol i uses table entry
``sym_base[g, c] + q`` and lane ``i % LANES``. Each lane is a 64-bit rANS state in
``[RANS_L, 2**32 * RANS_L)``, RANS_L = 2**31, renormalized by 32-bit words:

    encode (symbols in reverse):  if x >= (RANS_L >> 12 << 32) * f: emit x & 0xffffffff, x >>= 32
                                  x = (x // f) << 12 | (x % f) + cum
    decode (symbols in order):    slot = x & 4095; symbol = the entry whose [cum, cum + f) holds slot
                                  x = f * (x >> 12) + slot - cum; if x < RANS_L: x = x << 32 | next word

The substream's words are, front to back: each lane's final encoder state (high word, low word,
lane 0 first), then the renormalization words in the order the decoder consumes them (within one
step of LANES symbols, in lane order). Encoders start every lane at RANS_L, so a decoder that ends
with every lane at RANS_L and every word consumed has verified the substream; anything else is
`CorruptBlobError`. A substream with no symbols has no words. Lanes give a CPU independent
dependency chains (ILP) and cost 8 bytes each per substream (~0.01 bits/value on SmolLM2 chunks).

This module is the definition: `encode_reference` / `decode_reference` (numpy, vectorized over
all substreams and lanes, one step of LANES symbols at a time) give exactly the bytes / values of
the native kernels (`lmcache/native/cachegen_kernels.c`), which are ~50x faster.
"""

from __future__ import annotations

import numpy as np

from lmcache.cachegen.layout import CodeLayout
from lmcache.storage_backend.serde.serde import CorruptBlobError

PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
LANES = 8
RANS_L = 1 << 31
_MASK32 = np.uint64(0xFFFFFFFF)


def normalize(counts: np.ndarray, layout: CodeLayout) -> np.ndarray:
    """Symbol counts int64 [num_symbols] -> frequencies uint32 [num_symbols], each group's summing
    to PROB_SCALE: ``1 + floor(count * (PROB_SCALE - k) / total)`` for the k symbols that occur
    (0 for the others), the remainder added to the group's most frequent symbol."""
    starts, sizes = layout.group_start, layout.group_size
    gidx = np.repeat(np.arange(len(sizes)), sizes)
    counts = np.asarray(counts, np.int64)
    occurs = counts > 0
    total = np.add.reduceat(counts, starts) if len(starts) else np.zeros(0, np.int64)
    nonzero = np.add.reduceat(occurs.astype(np.int64), starts) if len(starts) else total
    if np.any(total == 0):
        raise ValueError("a symbol group has no symbols to count")
    freq = np.where(occurs, 1 + counts * (PROB_SCALE - nonzero[gidx]) // total[gidx], 0)
    rest = PROB_SCALE - np.add.reduceat(freq, starts)
    most = np.flatnonzero(counts == np.maximum.reduceat(counts, starts)[gidx])
    top = most[np.searchsorted(most, starts)]  # the group's most frequent symbol (first of ties)
    freq[top] += rest
    return freq.astype(np.uint32)


def cumulative(freq: np.ndarray, layout: CodeLayout) -> np.ndarray:
    """Each entry's start within its group's [0, PROB_SCALE): uint32 [num_symbols]."""
    csum = np.cumsum(freq, dtype=np.int64)
    before = np.repeat(csum[layout.group_start] - freq[layout.group_start], layout.group_size)
    return (csum - freq - before).astype(np.uint32)


def check_tables(freq: np.ndarray, layout: CodeLayout) -> None:
    """Raise CorruptBlobError unless every group's frequencies sum to PROB_SCALE."""
    if len(freq) != layout.num_symbols:
        raise CorruptBlobError(f"{len(freq)} table entries for {layout.num_symbols} symbols")
    if len(freq) and np.any(np.add.reduceat(freq.astype(np.int64), layout.group_start) != PROB_SCALE):
        raise CorruptBlobError(f"a symbol group's frequencies do not sum to {PROB_SCALE}")


def slot_table(freq: np.ndarray, layout: CodeLayout) -> np.ndarray:
    """uint16 [N * PROB_SCALE]: for each group and slot, the local index of the symbol owning it
    (needs `check_tables` first)."""
    local = np.arange(len(freq)) - np.repeat(layout.group_start, layout.group_size)
    return np.repeat(local, freq.astype(np.int64)).astype(np.uint16)


def region_starts(ncoded: np.ndarray, block_starts: np.ndarray) -> np.ndarray:
    """Word offsets [B * G + 1] of buffer regions large enough for any substream's words, for
    pairs with ncoded [G] coded channels and token blocks at block_starts [B + 1]."""
    rows = np.tile(ncoded, len(block_starts) - 1)  # the native encoder keeps a row's worth free
    symbols = (np.diff(block_starts)[:, None] * ncoded[None, :]).reshape(-1)
    cap = (symbols * PROB_BITS + 31) // 32 + rows + 3 * LANES + 8
    return np.concatenate([[0], np.cumsum(cap)]).astype(np.int64)


def _entries(layout: CodeLayout, values: np.ndarray) -> np.ndarray:
    """Per substream, per symbol in coding order: values[g, t, c] (-1 past its end) [S, n_max]."""
    nsub = layout.substream_symbols()
    width = int(-(-max(int(nsub.max(initial=0)), 1) // LANES) * LANES)
    out = np.full((len(nsub), width), -1, np.int64)
    npairs = layout.num_pairs
    for b in range(layout.num_blocks):
        t0, t1 = layout.block_starts[b], layout.block_starts[b + 1]
        for g in range(npairs):
            chans = layout.chans[g, :layout.ncoded[g]]
            n = nsub[b * npairs + g]
            out[b * npairs + g, :n] = values[g, t0:t1][:, chans].reshape(-1)
    return out


def encode_reference(q: np.ndarray, layout: CodeLayout, freq: np.ndarray) -> list[np.ndarray]:
    """q int16 [G, T, C] -> the words (uint32) of every substream s = b * G + g."""
    entries = _entries(layout, q.astype(np.int64) + layout.sym_base[:, None, :])
    nsub = layout.substream_symbols()
    regions = region_starts(layout.ncoded, layout.block_starts)
    buf = np.zeros(int(regions[-1]), np.uint32)
    ptr = regions[1:].copy()
    cum = cumulative(freq, layout).astype(np.uint64)
    freq64 = freq.astype(np.uint64)
    x = np.full((len(nsub), LANES), RANS_L, np.uint64)
    for k in range(entries.shape[1] // LANES - 1, -1, -1):
        e = entries[:, k * LANES:(k + 1) * LANES]
        active = e >= 0
        e = np.where(active, e, 0)
        f = np.where(active, freq64[e], np.uint64(1))
        emit = active & (x >= (f << np.uint64(51)))  # (RANS_L >> 12) << 32 = 2**51
        later: np.ndarray = np.cumsum(emit[:, ::-1], axis=1)[:, ::-1] - emit  # emitting lanes above
        rows, lanes = np.nonzero(emit)
        buf[ptr[rows] - 1 - later[rows, lanes]] = (x[rows, lanes] & _MASK32).astype(np.uint32)
        ptr -= emit.sum(axis=1)
        x = np.where(emit, x >> np.uint64(32), x)
        quot = x // f
        coded = (quot << np.uint64(PROB_BITS)) + (x - quot * f) + cum[e]
        x = np.where(active, coded, x)
    streams = []
    for s, n in enumerate(nsub):
        if n == 0:
            streams.append(np.zeros(0, np.uint32))
            continue
        head = np.stack([(x[s] >> np.uint64(32)), x[s] & _MASK32], axis=1).astype(np.uint32)
        streams.append(np.concatenate([head.reshape(-1), buf[ptr[s]:regions[s + 1]]]))
    return streams


def decode_reference(words: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
                     layout: CodeLayout, freq: np.ndarray, ntok: int) -> np.ndarray:
    """Every substream (words[offsets[s]:offsets[s] + lengths[s]]) -> symbols int32 [G, T, C]
    (single-symbol channels included). Raises CorruptBlobError for an invalid substream."""
    nsub = layout.substream_symbols()
    group_seq = _entries(layout, np.broadcast_to(
        layout.group_of[:, None, :], (layout.num_pairs, ntok, layout.group_of.shape[1])))
    valid = nsub > 0
    if np.any(lengths[~valid] != 0) or np.any(lengths[valid] < 2 * LANES):
        raise CorruptBlobError("cachegen substream is shorter than its lane states")
    words64 = np.append(words.astype(np.uint64), np.zeros(2, np.uint64))  # heads of empty ones: 0, 1
    heads = np.where(valid[:, None], offsets[:, None] + 2 * np.arange(LANES)[None, :], 0)
    x = (words64[heads] << np.uint64(32)) | words64[heads + 1]
    x = np.where(valid[:, None], x, np.uint64(RANS_L))
    read = np.full(len(nsub), 2 * LANES, np.int64)
    slots = slot_table(freq, layout)
    cum = cumulative(freq, layout).astype(np.uint64)
    freq64 = freq.astype(np.uint64)
    decoded = np.full(group_seq.shape, -1, np.int64)
    for k in range(group_seq.shape[1] // LANES):
        gid = group_seq[:, k * LANES:(k + 1) * LANES]
        active = gid >= 0
        gid = np.where(active, gid, 0)
        slot = (x & np.uint64(PROB_SCALE - 1)).astype(np.int64)
        local = slots[gid * PROB_SCALE + slot].astype(np.int64)
        entry = layout.group_start[gid] + local
        stepped = freq64[entry] * (x >> np.uint64(PROB_BITS)) + slot.astype(np.uint64) - cum[entry]
        need = active & (stepped < np.uint64(RANS_L))
        pos = read[:, None] + np.cumsum(need, axis=1) - need
        if np.any(need & (pos >= lengths[:, None])):
            raise CorruptBlobError("cachegen substream ends before its symbols (truncated or corrupt)")
        rows, lanes = np.nonzero(need)
        stepped[rows, lanes] = (stepped[rows, lanes] << np.uint64(32)) | \
            words64[offsets[rows] + pos[rows, lanes]]
        read += need.sum(axis=1)
        x = np.where(active, stepped, x)
        decoded[:, k * LANES:(k + 1) * LANES] = np.where(active, local, -1)
    if np.any(x != np.uint64(RANS_L)) or np.any(read[valid] != lengths[valid]):
        raise CorruptBlobError("cachegen substream does not decode to its symbols (corrupt)")
    return _symbols(decoded, layout, ntok)


def _symbols(decoded: np.ndarray, layout: CodeLayout, ntok: int) -> np.ndarray:
    """Local symbol indices per substream -> symbol values int32 [G, T, C]."""
    npairs, nch = layout.group_of.shape
    q = np.broadcast_to(layout.group_low[layout.group_of][:, None, :], (npairs, ntok, nch)).copy()
    nsub = layout.substream_symbols()
    for b in range(layout.num_blocks):
        t0, t1 = layout.block_starts[b], layout.block_starts[b + 1]
        for g in range(npairs):
            chans = layout.chans[g, :layout.ncoded[g]]
            local = decoded[b * npairs + g, :nsub[b * npairs + g]].reshape(t1 - t0, len(chans))
            q[g, t0:t1][:, chans] += local.astype(np.int32)
    return q
