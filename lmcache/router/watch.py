"""`KVWatch`: what a fleet's instances hold, for the policies that route by it: one `KVIndex` fed
by an `EventSubscriber` per instance, a `SharedIndex` fed by the event streams of cache servers the
instances share, and the model's tokenizer to match requests against them. Shared by `lmcache
router` (``kv-aware``) and its prefill/decode front (``--prefill-policy kv-aware``)."""

from __future__ import annotations

import asyncio
import functools
from contextlib import AbstractContextManager
from typing import Any

from lmcache.router.events import EventSubscriber
from lmcache.router.index import KVIndex, Match
from lmcache.router.shared import SharedIndex
from lmcache.router.tokens import PromptTokenizer


class KVWatch:
    def __init__(self, urls: tuple[str, ...], endpoints: tuple[str, ...], model: str | None,
                 max_blocks: int = 200_000, tier_weights: dict[str, float] | None = None,
                 shared: tuple[str, ...] = ()) -> None:
        """`endpoints[i]`: the KV events of `urls[i]` (none: nothing is indexed); `shared`: the KV
        events of cache servers every instance is attached to; `model`: the tokenizer's folder
        (None: requests are not tokenized)."""
        self.index = KVIndex(max_blocks, tier_weights)
        self.shared = SharedIndex(max_blocks, self.index.tier_weights)
        self.tokenizer = PromptTokenizer(model) if model else None
        self.subscribers = [EventSubscriber(endpoint, functools.partial(self.index.apply, url))
                            for url, endpoint in zip(urls, endpoints, strict=False)]
        self.subscribers += [EventSubscriber(endpoint, self.shared.apply, token_ids=False)
                             for endpoint in shared]

    def match(self, url: str, tokens: list[int], extra_key: str | None = None) -> Match:
        """The prefix of `tokens` instance `url` can serve without computing it: what it holds itself,
        extended by what the shared cache servers hold (under `extra_key`, the request's
        `lmcache.chunk_hash.extra_key_of`)."""
        return self.index.match(url, tokens).then(self.shared.match(tokens, extra_key))

    def sending(self, url: str, tokens: list[int] | None) -> AbstractContextManager[None]:
        """`tokens`, sent to instance `url`, count as cached there while the block runs (until
        their answer has ended): see `KVIndex.sending`."""
        return self.index.sending(url, tokens)

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
