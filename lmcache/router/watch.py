"""`KVWatch`: what a fleet's instances hold, for the policies that route by it: one `KVIndex` fed
by an `EventSubscriber` per instance, a `SharedIndex` fed by the event streams of cache servers the
instances share, and the model's tokenizer to match requests against them. Shared by `lmcache
router` (``kv-aware``) and its prefill/decode front (``--prefill-policy kv-aware``)."""

from __future__ import annotations

import asyncio
import functools
from contextlib import AbstractContextManager
from typing import Any

from lmcache.chunk_hash import extra_key_of
from lmcache.router.events import EventSubscriber
from lmcache.router.index import NO_REQUEST_KEYS, KVIndex, Match, RequestKeys
from lmcache.router.shared import SharedIndex
from lmcache.router.tokens import PromptTokenizer


class KVWatch:
    def __init__(self, urls: tuple[str, ...], endpoints: tuple[str, ...], model: str | None,
                 max_blocks: int = 200_000, tier_weights: dict[str, float] | None = None,
                 shared: tuple[str, ...] = ()) -> None:
        """`endpoints[i]`: the KV events of `urls[i]` (none: nothing is indexed); `shared`: the KV
        events of cache servers every instance is attached to; `model`: the tokenizer's folder
        (None: requests are not tokenized). ValueError if an endpoint cannot be subscribed to (no
        subscriber is left running then)."""
        self.index = KVIndex(max_blocks, tier_weights)
        self.shared = SharedIndex(max_blocks, self.index.tier_weights)
        self.tokenizer = PromptTokenizer(model) if model else None
        self.subscribers: list[EventSubscriber] = []
        try:
            for url, endpoint in zip(urls, endpoints, strict=False):
                self.subscribers.append(EventSubscriber(endpoint, functools.partial(self.index.apply, url)))
            for endpoint in shared:
                self.subscribers.append(EventSubscriber(endpoint, self.shared.apply, token_ids=False))
        except ValueError:  # an endpoint that cannot be subscribed to: none is left running
            self.close()
            raise

    def match(self, url: str, tokens: list[int], keys: RequestKeys = NO_REQUEST_KEYS) -> Match:
        """The prefix of `tokens` (a request with `keys`) instance `url` can serve without computing
        it: what it holds itself, extended by what the shared cache servers hold (under the chunk
        hashes' seed of its ``cache_salt``, `lmcache.chunk_hash.extra_key_of`: a LoRA adapter seeds
        them too, but the router does not know adapter ids, so there a LoRA request is matched as
        the base model's, an over-estimate)."""
        shared = self.shared.match(tokens, extra_key_of(keys.cache_salt))
        return self.index.match(url, tokens, keys).then(shared)

    def sending(self, url: str, tokens: list[int] | None,
                keys: RequestKeys = NO_REQUEST_KEYS) -> AbstractContextManager[None]:
        """`tokens` (of a request with `keys`), sent to instance `url`, count as cached there while
        the block runs (until their answer has ended): see `KVIndex.sending`."""
        return self.index.sending(url, tokens, keys)

    async def tokens(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The request's prompt tokens (None without a tokenizer or for a body it cannot read)."""
        if self.tokenizer is None:
            return None
        return await asyncio.to_thread(self.tokenizer, path, body)

    def counts(self) -> dict[str, Any]:
        return {"index": {"evicted": self.index.evicted, "orphans": self.index.orphans,
                          "shared_blocks": len(self.shared), "shared_evicted": self.shared.evicted},
                "events": {s.endpoint: s.counts() for s in self.subscribers}}

    def close(self) -> None:
        for subscriber in self.subscribers:
            subscriber.close()
