"""`KVWatch`: what a fleet's instances hold, for the policies that route by it: one `KVIndex` fed
by an `EventSubscriber` per instance, and the model's tokenizer to match requests against it.
Shared by `lmcache router` (``kv-aware``) and its prefill/decode front (``--prefill-policy
kv-aware``)."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from lmcache.router.events import EventSubscriber
from lmcache.router.index import KVIndex
from lmcache.router.tokens import PromptTokenizer


class KVWatch:
    def __init__(self, urls: tuple[str, ...], endpoints: tuple[str, ...], model: str | None,
                 max_blocks: int = 200_000, tier_weights: dict[str, float] | None = None) -> None:
        """`endpoints[i]`: the KV events of `urls[i]` (none: nothing is indexed); `model`: the
        tokenizer's folder (None: requests are not tokenized)."""
        self.index = KVIndex(max_blocks, tier_weights)
        self.tokenizer = PromptTokenizer(model) if model else None
        self.subscribers = [EventSubscriber(endpoint, functools.partial(self.index.apply, url))
                            for url, endpoint in zip(urls, endpoints, strict=False)]

    async def tokens(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The request's prompt tokens (None without a tokenizer or for a body it cannot read)."""
        if self.tokenizer is None:
            return None
        return await asyncio.to_thread(self.tokenizer, path, body)

    def counts(self) -> dict[str, Any]:
        return {"index": {"evicted": self.index.evicted, "orphans": self.index.orphans},
                "events": {s.endpoint: s.counts() for s in self.subscribers}}

    def close(self) -> None:
        for subscriber in self.subscribers:
            subscriber.close()
