"""The engine's HTTP controller (opt-in `controller_url`): ask what is cached and where, clear
a tier, pin a prefix, check health, read counters. JSON in and out.

    GET  /health  -> {"status": "ok" | "degraded", "tiers": {tier: works}}
    GET  /stats   -> {"engine": {counter: value}, "tiers": {tier: {"counters": {...}, "gauges": {...}}}}
    POST /lookup  {"tokens": [int, ...] | "text": str, "extra_key"?: str}
                  -> {"tokens": n, "cached_tokens": prefix cached in any tier,
                      "tiers": {tier: prefix cached in that tier alone},
                      "peers": {address: prefix that peer holds}}
    POST /clear   {"tier": "hot" | "disk" | "all"} -> {"cleared": {tier: chunks dropped}}
    POST /pin     {"tokens" | "text", "extra_key"?, "ttl"?: seconds > 0, finite (default 3600)}
                  -> {"pinned_tokens": n, "lease": id}: the cached prefix stays cached (in
                  whichever tier holds it) until unpinned or the ttl ends
    POST /unpin   {"tokens" | "text", "extra_key"?} or {"lease": id} -> {"released": id}

"text" needs a tokenizer (`tokenize`, set by the integration that knows the model). Bad input —
a body that is not a JSON object, unknown or missing fields, wrong types — gets 400 with
{"error": message}; an unknown path 404, a wrong method 405, a body over 16 MiB 413. The
server binds to `controller_url`'s host (loopback unless configured), on its own threads
(`json_http`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any, Protocol

import torch
import xxhash

from lmcache.json_http import BadRequest, JsonHTTPService, fields, opt_str, token_ids
from lmcache.observability import EngineStats
from lmcache.storage_backend.peer_backend import PeerBackend
from lmcache.storage_backend.storage_manager import StorageManager
from lmcache.token_database import TokenDatabase

logger = logging.getLogger(__name__)
DEFAULT_PIN_TTL = 3600.0


class ControlledEngine(Protocol):
    """What the controller uses of an engine (`LMCacheEngine` is one)."""

    storage_manager: StorageManager
    token_database: TokenDatabase
    stats: EngineStats

    def lookup(self, tokens: torch.Tensor, search_range: str | list[str] | None = None, *,
               extra_key: str | None = None, lease_id: str | None = None, lease_ttl: float = 60.0,
               count: bool = True) -> int: ...

    def release(self, lease_id: str) -> None: ...


class Controller(JsonHTTPService):
    def __init__(self, engine: ControlledEngine, host: str, port: int,
                 tokenize: Callable[[str], list[int]] | None = None) -> None:
        self.engine = engine
        self.tokenize = tokenize
        routes = {
            ("GET", "/health"): self.health, ("GET", "/stats"): self.stats,
            ("POST", "/lookup"): self.lookup, ("POST", "/clear"): self.clear,
            ("POST", "/pin"): self.pin, ("POST", "/unpin"): self.unpin,
        }
        super().__init__(routes, host, port, "controller")

    # ---- endpoints --------------------------------------------------------------------------------

    def health(self, body: dict[str, Any]) -> dict[str, Any]:
        fields(body, set())
        tiers = self.engine.storage_manager.health()
        return {"status": "ok" if all(tiers.values()) else "degraded", "tiers": tiers}

    def stats(self, body: dict[str, Any]) -> dict[str, Any]:
        fields(body, set())
        return self.engine.stats.report()

    def lookup(self, body: dict[str, Any]) -> dict[str, Any]:
        fields(body, {"tokens", "text", "extra_key"})
        tokens, extra_key = prompt_tokens(body, self.tokenize), opt_str(body, "extra_key")
        sm = self.engine.storage_manager
        per_tier = {t.name: self.engine.lookup(tokens, t.name, extra_key=extra_key, count=False)
                    for t in sm.tiers}
        chunks = list(self.engine.token_database.process_tokens(tokens, extra_key=extra_key))
        peers: dict[str, int] = {}
        for tier in sm.tiers:
            if isinstance(tier, PeerBackend):
                holders = tier.lookup.holders([key for _, _, key in chunks])
                for peer in sorted({p for h in holders for p in h}):
                    held = next((i for i, h in enumerate(holders) if peer not in h), len(holders))
                    peers[peer] = chunks[held - 1][1] if held else 0
        cached = self.engine.lookup(tokens, extra_key=extra_key, count=False)
        return {"tokens": int(tokens.shape[0]), "cached_tokens": cached, "tiers": per_tier, "peers": peers}

    def clear(self, body: dict[str, Any]) -> dict[str, Any]:
        fields(body, {"tier"}, required={"tier"})
        which = body["tier"]
        if which not in self.engine.storage_manager.CLEARABLE:
            raise BadRequest(f"'tier' must be one of {list(self.engine.storage_manager.CLEARABLE)}, "
                             f"got {which!r}")
        return {"cleared": self.engine.storage_manager.clear(which)}

    def pin(self, body: dict[str, Any]) -> dict[str, Any]:
        tokens, extra_key, ttl, lease = pin_request(body, self.tokenize)
        hit = self.engine.lookup(tokens, extra_key=extra_key, lease_id=lease, lease_ttl=ttl, count=False)
        return {"pinned_tokens": hit, "lease": lease}

    def unpin(self, body: dict[str, Any]) -> dict[str, Any]:
        lease = unpin_request(body, self.tokenize)
        self.engine.release(lease)
        return {"released": lease}


# ---- requests (shared with the cache server's operations endpoint) --------------------------------

def prompt_tokens(body: dict[str, Any], tokenize: Callable[[str], list[int]] | None) -> torch.Tensor:
    """The prompt of a request body: its ``tokens``, or its ``text`` through `tokenize`."""
    if ("tokens" in body) == ("text" in body):
        raise BadRequest("give exactly one of 'tokens' (a list of token ids) or 'text'")
    if "text" in body:
        if not isinstance(body["text"], str):
            raise BadRequest("'text' must be a string")
        if tokenize is None:
            raise BadRequest("no tokenizer here: send 'tokens'")
        ids: Any = tokenize(body["text"])
    else:
        ids = token_ids(body)
    if not ids:
        raise BadRequest("the prompt is empty")
    return torch.tensor(ids, dtype=torch.int64)


def pin_request(body: dict[str, Any], tokenize: Callable[[str], list[int]] | None
                ) -> tuple[torch.Tensor, str | None, float, str]:
    """A ``/pin`` body: the prompt, its extra key, the pin's ttl and its lease id."""
    fields(body, {"tokens", "text", "extra_key", "ttl"})
    tokens, extra_key = prompt_tokens(body, tokenize), opt_str(body, "extra_key")
    ttl = body.get("ttl", DEFAULT_PIN_TTL)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= sys.float_info.max:
        raise BadRequest(f"'ttl' must be a finite number of seconds > 0, got {ttl!r}")
    return tokens, extra_key, float(ttl), _pin_id(tokens, extra_key)


def unpin_request(body: dict[str, Any], tokenize: Callable[[str], list[int]] | None) -> str:
    """The lease id an ``/unpin`` body names (by ``lease``, or by the prompt it pinned)."""
    fields(body, {"tokens", "text", "extra_key", "lease"})
    if "lease" in body:
        if set(body) != {"lease"} or not isinstance(body["lease"], str):
            raise BadRequest("give either 'lease' (a string) alone, or 'tokens' / 'text'")
        return str(body["lease"])
    return _pin_id(prompt_tokens(body, tokenize), opt_str(body, "extra_key"))


def _pin_id(tokens: torch.Tensor, extra_key: str | None) -> str:
    digest = xxhash.xxh3_64_hexdigest(tokens.numpy().tobytes() + (extra_key or "").encode())
    return f"pin:{digest}"
