"""`KVIndex`: which instance holds which prefix blocks, in which tier, learned from KV events.

Each ``BlockStored`` block gets the router's own chained hash ``h = xxh3_64(parent_h, keys, token
ids)`` (parent_h = 0 for a first block), so the index does not depend on vLLM's hash seed: a
prompt's tokens cut into blocks of the same size hash to the same chain. ``keys`` are what vLLM
hashes into a block besides its tokens (`generate_block_hash_extra_keys`), as its events publish
them: the event's ``lora_name`` and the block's ``extra_keys`` entry (the LoRA adapter's name in
every block of a LoRA request, the ``cache_salt`` in its first block, multimodal ids). A request's
side is `RequestKeys` (its ``cache_salt``, and its ``model`` where that names a LoRA adapter the
instance holds blocks of), so blocks stored for another salt or adapter, or with multimodal inputs
(which the router does not tokenize), never match. LMCache's connector publishes its tiers' blocks
with vLLM's hashes and extra keys (`lmcache.integration.vllm.kv_events`): they chain the same way.
The event's block hash (vLLM's, or LMCache's in its own events) is mapped, per instance and medium,
to the router's hash so that parent links (looked up in the block's medium first, then in any
other) and ``BlockRemoved`` work. ``AllBlocksCleared`` is vLLM's prefix-cache reset (LMCache's
connector and cache server never send it: it names no medium), so it drops the instance's blocks
in vLLM's own media (`ENGINE_MEDIA`) and keeps what LMCache's tiers hold.

`match(instance, tokens, keys)` walks the prompt's chain (for every block size the instance holds
blocks of) while the instance holds the block in any tier, and returns the cached prefix: tokens,
tokens per tier, and tokens weighted by the best tier that holds each block (`tier_weights`; a
medium not named there weighs `DEFAULT_WEIGHT`).

Prompts in flight (`sending`): vLLM caches a prompt's blocks when it schedules the prompt, so a
request that reaches an instance while another one's prefill runs there finds that prompt's blocks
already; their ``BlockStored`` events come only after the step that computes them. So the blocks of
the prompts the router has sent to an instance and not yet seen answered count as held there by
vLLM's prefix cache (medium None), cut at the block size of that instance's own events (nothing
counts before its first event gave it).

Bounded: at most `max_blocks` (medium, block) entries per instance, the oldest stored evicted first
(``evicted``); what the index keeps besides (block sizes, adapter names) is counted per entry and
goes with the last entry that had it. A ``BlockStored`` of no blocks is ignored. A block whose
parent is unknown (evicted, or its events were missed) cannot be chained and is skipped
(``orphans``). Thread-safe (subscribers write, the router reads).
"""

from __future__ import annotations

import threading
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec
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
_encoder = msgspec.msgpack.Encoder()


def block_key(lora_name: str | None, extra_keys: Sequence[Any] | None) -> bytes:
    """What a block is hashed with besides its tokens: its adapter and extra keys as an event names
    them (a tuple and a list of the same keys are the same); b"" for none."""
    if lora_name is None and not extra_keys:
        return b""
    return _encoder.encode((lora_name, extra_keys or None))


def chain_hash(parent: int, tokens: Sequence[int], key: bytes = b"") -> int:
    """`tokens`: ids below 2**32 (`events.MAX_TOKEN_ID`; a prompt's ids beyond cannot be cached);
    `key`: the block's `block_key`."""
    h = xxhash.xxh3_64(parent.to_bytes(8, "little"))
    h.update(len(key).to_bytes(4, "little"))
    h.update(key)
    h.update(array("I", tokens).tobytes())  # 4 bytes an id
    return h.intdigest()


class BlockKeys(NamedTuple):
    """The `block_key` of a request's first block and of the others."""

    first: bytes
    rest: bytes


NO_KEYS = BlockKeys(b"", b"")


def block_chain(tokens: Sequence[int], size: int, keys: BlockKeys = NO_KEYS) -> Iterator[int]:
    """The chained hashes of the whole `size`-token blocks of `tokens`, first to last."""
    parent = 0
    for start in range(0, len(tokens) - size + 1, size):
        parent = chain_hash(parent, tokens[start:start + size], keys.rest if start else keys.first)
        yield parent


@dataclass(frozen=True)
class RequestKeys:
    """What, besides its tokens, a request's blocks are hashed with, as its body names it: its
    ``cache_salt`` (vLLM puts it in the first block's extra keys) and its ``model`` (the LoRA
    adapter vLLM puts in every block's, where it names one)."""

    cache_salt: str | None = None
    model: str | None = None

    def blocks(self, lora_name: str | None) -> BlockKeys:
        """The keys of the request's blocks, `lora_name` the adapter serving it (None: the base model),
        as vLLM's events publish them (`to_event_extra_keys`: adapter first, salt after)."""
        rest = (lora_name,) if lora_name else ()
        first = rest + ((self.cache_salt,) if self.cache_salt else ())
        return BlockKeys(block_key(lora_name, first), block_key(lora_name, rest))


NO_REQUEST_KEYS = RequestKeys()  # no salt, the base model


@dataclass
class Match:
    tokens: int = 0  # the cached prefix, in tokens
    weighted: float = 0.0  # the same, each block weighted by the best tier holding it
    by_tier: dict[str, int] = field(default_factory=dict)  # tokens per best tier ("GPU" for None)
    block_size: int = 1  # of the blocks (chunks) ending the prefix
    loaded: bool = False  # its end is loaded by LMCache's connector (a shared cache server's chunks)

    def then(self, further: Match) -> Match:
        """This prefix extended by the tokens `further` (another source's prefix of the same prompt:
        a shared cache server's, which LMCache's connector loads) holds beyond it, weighted as
        `further` weighs them on average and counted in `by_tier` as ``"shared"``."""
        if further.tokens <= self.tokens:
            return self
        extra = further.tokens - self.tokens
        return Match(further.tokens, self.weighted + extra * further.weighted / further.tokens,
                     self.by_tier | {"shared": extra}, further.block_size, loaded=True)

    def servable(self, prompt_tokens: int) -> int:
        """The cached tokens an engine can use for a prompt of `prompt_tokens`: it computes at least
        the last token, so a prefix covering the whole prompt is cut: to whole blocks by vLLM's
        prefix cache, to the last token but one by LMCache's connector when it loads the end
        (`lmcache.integration.vllm.scheduler`: ``min(cached, prompt - 1)``)."""
        if self.tokens < prompt_tokens:
            return self.tokens
        if self.loaded:
            return prompt_tokens - 1
        return (prompt_tokens - 1) // self.block_size * self.block_size


class _Entry(NamedTuple):
    own: int  # the router's hash of the block
    size: int  # its block size
    lora_name: str | None


class _Instance:
    def __init__(self) -> None:
        self.entries: OrderedDict[TierKey, _Entry] = OrderedDict()  # (medium, event hash), oldest first
        self.by_hash: dict[BlockHash, dict[str | None, int]] = {}  # event hash -> {medium: own hash}
        self.tiers: dict[int, dict[str | None, int]] = {}  # own hash -> entries per medium
        self.block_sizes: dict[int, int] = {}  # entries per block size
        self.loras: dict[str, int] = {}  # entries per LoRA adapter
        self.engine_block_size: int | None = None  # of vLLM's own blocks (its events say)
        self.sending: Counter[int] = Counter()  # own hash -> prompts in flight holding that block

    def add(self, key: TierKey, entry: _Entry) -> None:
        self.drop(key)
        self.entries[key] = entry
        self.by_hash.setdefault(key[1], {})[key[0]] = entry.own
        _count(self.tiers.setdefault(entry.own, {}), key[0])
        _count(self.block_sizes, entry.size)
        if entry.lora_name is not None:
            _count(self.loras, entry.lora_name)

    def drop(self, key: TierKey) -> None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return
        media = self.by_hash[key[1]]
        del media[key[0]]
        if not media:
            del self.by_hash[key[1]]
        _release(self.tiers[entry.own], key[0])
        if not self.tiers[entry.own]:
            del self.tiers[entry.own]
        _release(self.block_sizes, entry.size)
        if entry.lora_name is not None:
            _release(self.loras, entry.lora_name)

    def parent(self, event: BlockStored) -> int | None:
        """The router's hash of `event`'s parent block (0 for none; None: unknown)."""
        if event.parent_block_hash is None:
            return 0
        media = self.by_hash.get(event.parent_block_hash)
        if not media:
            return None
        return media.get(event.medium, next(iter(media.values())))

    def keys(self, request: RequestKeys) -> BlockKeys:
        """`request`'s block keys here: its model is a LoRA adapter if this instance holds blocks of it."""
        return request.blocks(request.model if request.model in self.loras else None)


def _count(counts: dict[Any, int], key: Any) -> None:
    counts[key] = counts.get(key, 0) + 1


def _release(counts: dict[Any, int], key: Any) -> None:
    counts[key] -= 1
    if not counts[key]:
        del counts[key]


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
                        inst.drop((event.medium, h))
                elif isinstance(event, AllBlocksCleared):  # prompts in flight store their blocks again
                    for key in [k for k in inst.entries if k[0] in ENGINE_MEDIA]:
                        inst.drop(key)

    def _store(self, inst: _Instance, event: BlockStored) -> None:
        if not event.block_hashes:
            return
        parent = inst.parent(event)
        if parent is None:
            self.orphans += len(event.block_hashes)
            return
        size, lora = event.block_size, event.lora_name
        if event.medium in ENGINE_MEDIA:
            inst.engine_block_size = size
        for i, h in enumerate(event.block_hashes):
            key = block_key(lora, event.extra_keys[i] if event.extra_keys else None)
            parent = chain_hash(parent, event.token_ids[i * size:(i + 1) * size], key)
            inst.add((event.medium, h), _Entry(parent, size, lora))
        while len(inst.entries) > self.max_blocks:
            inst.drop(next(iter(inst.entries)))
            self.evicted += 1

    @contextmanager
    def sending(self, instance: str, tokens: Sequence[int] | None,
                keys: RequestKeys = NO_REQUEST_KEYS) -> Iterator[None]:
        """`tokens`, a prompt sent to `instance` (with `keys`), counts as held there (see the module
        doc) while the block runs: from before it is sent until its answer has ended."""
        with self._lock:
            inst = self._instances.get(instance)
            size = None if inst is None else inst.engine_block_size
            held: Counter[int] = Counter() if inst is None else inst.sending  # kept across a clear
            chain: Counter[int] = Counter()
            if inst is not None and size is not None and tokens is not None:
                chain.update(block_chain(tokens, size, inst.keys(keys)))
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

    def match(self, instance: str, tokens: Sequence[int], keys: RequestKeys = NO_REQUEST_KEYS) -> Match:
        """The longest prefix of `tokens` (a request with `keys`) that `instance` holds, over the
        block sizes it holds blocks of."""
        with self._lock:
            inst = self._instances.get(instance)
            if inst is None:
                return Match()
            sizes, engine = list(inst.block_sizes), inst.engine_block_size
            if inst.sending and engine is not None and engine not in inst.block_sizes:
                sizes.append(engine)
            hashed = inst.keys(keys)
            return max((self._walk(inst, tokens, size, hashed) for size in sizes),
                       key=lambda m: (m.weighted, m.tokens), default=Match())

    def _walk(self, inst: _Instance, tokens: Sequence[int], size: int, keys: BlockKeys) -> Match:
        found = Match(block_size=size)
        in_flight = size == inst.engine_block_size
        for parent in block_chain(tokens, size, keys):
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
