"""The cache server's operations endpoint (HTTP, JSON; `lmcache health|stats|lookup|clear --url`
work against it as against an engine's controller):

    GET  /health  -> {"status": "ok" | "degraded", "session": id, "tiers": {model: {tier: works}}}
    GET  /stats   -> the server's numbers: arena, engines (one entry per attached engine), each
                     model's tiers, server counters (`CacheServer.stats`)
    GET  /metrics -> the same as Prometheus text (prefix ``lmcache_server:``): per engine
                     (label ``engine``), per model and tier (labels ``model``, ``tier``)
    POST /lookup  {"tokens": [int, ...], "extra_key"?: str}
                  -> {"tokens": n, "models": {model: {"cached_tokens": n, "tiers": {tier: n}}}}
    POST /clear   {"tier": "hot" | "disk" | "all"} -> {"cleared": {model: {tier: chunks dropped}}}
    POST /pin     {"tokens": [...], "extra_key"?, "ttl"?: seconds (default 3600)}
                  -> {"lease": id, "models": {model: pinned tokens}}: each model's cached prefix
                  stays cached (lower-tier chunks are brought into L1) until unpinned or the ttl ends
    POST /unpin   {"tokens": [...], "extra_key"?} or {"lease": id} -> {"released": id}

The server has no tokenizer: prompts are token ids (`lmcache pin --tokens`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from lmcache.cache_server.server import CacheServer
from lmcache.controller import pin_request, unpin_request
from lmcache.json_http import BadRequest, JsonHTTPService, RawReply, Route, fields, opt_str, token_ids
from lmcache.storage_backend.storage_manager import StorageManager

PREFIX = "lmcache_server:"
ENGINE_GAUGES = ("slots_reserved", "reads_held", "leases", "seconds_since_heard")
ENGINE_LABELS = ("name", "pid", "model", "watched")
ARENA_GAUGES = {"size": "bytes", "grown": "grown_bytes", "resident": "resident_bytes", "used": "used_bytes"}


class OpsEndpoint(JsonHTTPService):
    def __init__(self, server: CacheServer, host: str, port: int) -> None:
        self.server = server
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(server))
        routes: dict[tuple[str, str], Route] = {
            ("GET", "/health"): self.health, ("GET", "/stats"): self.stats, ("GET", "/metrics"): self.metrics,
            ("POST", "/lookup"): self.lookup, ("POST", "/clear"): self.clear,
            ("POST", "/pin"): self.pin, ("POST", "/unpin"): self.unpin}
        super().__init__(routes, host, port, "cache server operations")

    def health(self, body: dict[str, Any]) -> dict[str, Any]:
        fields(body, set())
        return self.server.health()

    def stats(self, body: dict[str, Any]) -> dict[str, Any]:
        fields(body, set())
        return self.server.stats()

    def metrics(self, body: dict[str, Any]) -> RawReply:
        fields(body, set())
        return RawReply("text/plain; version=0.0.4; charset=utf-8", generate_latest(self.registry))

    def lookup(self, body: dict[str, Any]) -> dict[str, Any]:
        fields(body, {"tokens", "extra_key"}, required={"tokens"})
        ids = token_ids(body)
        return {"tokens": len(ids), "models": self.server.lookup(torch.tensor(ids, dtype=torch.int64),
                                                                 opt_str(body, "extra_key"))}

    def clear(self, body: dict[str, Any]) -> dict[str, Any]:
        fields(body, {"tier"}, required={"tier"})
        if body["tier"] not in StorageManager.CLEARABLE:
            raise BadRequest(f"'tier' must be one of {list(StorageManager.CLEARABLE)}, "
                             f"got {body['tier']!r}")
        return {"cleared": self.server.clear(body["tier"])}

    def pin(self, body: dict[str, Any]) -> dict[str, Any]:
        tokens, extra_key, ttl, lease = pin_request(body, tokenize=None)
        return {"lease": lease, "models": self.server.pin(tokens, extra_key, lease, ttl)}

    def unpin(self, body: dict[str, Any]) -> dict[str, Any]:
        lease = unpin_request(body, tokenize=None)
        self.server.unpin(lease)
        return {"released": lease}


class _Collector(Collector):
    """Reads the server's numbers at every scrape."""

    def __init__(self, server: CacheServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Any]:
        stats = self.server.stats()
        arena = GaugeMetricFamily(PREFIX + "arena_bytes", "L1 arena bytes: size, grown (handed out from), "
                                  "resident (in memory), used (by chunks and slots)", labels=["kind"])
        for label, key in ARENA_GAUGES.items():
            arena.add_metric([label], stats["arena"][key])
        yield arena
        yield GaugeMetricFamily(PREFIX + "engines", "Engines attached", value=len(stats["engines"]))
        for name, value in sorted(stats["server"].items()):
            yield CounterMetricFamily(PREFIX + name, name.replace("_", " "), value=value)
        families: dict[str, Any] = {}

        def family(name: str, gauge: bool, labels: list[str]) -> Any:
            if name not in families:
                cls = GaugeMetricFamily if gauge else CounterMetricFamily
                families[name] = cls(PREFIX + name, name.replace("_", " "), labels=labels)
            return families[name]

        for engine_id, engine in stats["engines"].items():
            for name, value in engine.items():
                if name not in ENGINE_LABELS:
                    family("engine_" + name, name in ENGINE_GAUGES, ["engine", "name"]).add_metric(
                        [engine_id, engine["name"]], value)
        for model, tiers in self.server.tier_stats().items():
            for tier, tier_stats in tiers.items():
                for gauge, values in ((False, tier_stats.counters), (True, tier_stats.gauges)):
                    for name, value in values.items():
                        family("tier_" + name, gauge, ["model", "tier"]).add_metric([model, tier], value)
        yield from families.values()
