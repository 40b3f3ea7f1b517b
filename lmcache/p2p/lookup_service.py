"""`LookupService`: which instance holds which chunk keys, kept in a Valkey/Redis (`lookup_url`).

Data, under the URL's `namespace` (if any):

    lmcache:p2p:instances        SET of instance addresses ("host:port" of their peer servers)
    lmcache:p2p:alive:{addr}     "1", expiring `ttl` seconds after the instance's last heartbeat
    lmcache:p2p:keys:{addr}      SET of the chunk keys the instance holds, expiring with it

Expiry is the store's own (PEXPIRE), so instances on machines with different clocks agree, and a
dead instance's entries disappear by themselves `ttl` seconds after its last heartbeat.

- `add(keys)` / `remove(keys)` queue registrations; a background thread sends them in one
  pipeline per batch, never on a request's critical path, and sends the heartbeat every
  `ttl / 3` seconds. A failed batch is kept and sent again with the next one (bounded). The
  instance's registrations are kept here too: a heartbeat that finds its ``alive`` entry gone (the
  store restarted without its data, or the instance could not reach it for longer than `ttl`)
  publishes all of them again.
- `holders(keys)` answers, per key, the live instances other than this one that registered it:
  one pipelined round trip (plus one for the instance list, cached for `ttl / 3` seconds).
The store is one failure domain (`lmcache.failures`): while it fails, `holders` answers nobody (a
miss), registrations wait for the next batch, and it is logged once per incident; `fault_counts()`
says how many calls failed or were skipped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from lmcache.cache_key import CacheEngineKey
from lmcache.failures import FailureDomains
from lmcache.storage_backend.connectors import create_connector, parse_remote_url
from lmcache.storage_backend.connectors.redis_connector import RedisClientConnector

logger = logging.getLogger(__name__)
MAX_QUEUED = 1 << 20  # registrations kept while the store is unreachable
STORE = "store"  # the failure domain's name


class LookupService:
    def __init__(self, url: str, address: str, ttl: float, timeout: float) -> None:
        parsed = parse_remote_url(url)
        connector = create_connector(parsed, timeout)
        if not isinstance(connector, RedisClientConnector):
            connector.close()
            raise ValueError(f"lookup_url {url!r}: the lookup service needs a Valkey/Redis store")
        self._connector = connector
        self.client: Any = connector.client
        self.address = address
        self.ttl_ms = max(1, int(ttl * 1000))
        ns = f"{parsed.namespace}:" if parsed.namespace else ""
        self._instances = f"{ns}lmcache:p2p:instances"
        self._prefix = ns
        # never backed off for longer than a heartbeat period: registrations must not expire
        beat = max(ttl / 3, 0.01)
        self._store = FailureDomains(lambda _: f"peer lookup service {url}", min(0.5, beat), beat)
        self._cond = threading.Condition()
        self._adds: dict[str, None] = {}  # ordered sets
        self._removes: dict[str, None] = {}
        self._held: dict[str, None] = {}  # every key added and not removed (as many as local tiers hold)
        self._registered = False  # a heartbeat has reached the store
        self._peers: list[str] = []
        self._peers_at = -1.0
        self._sending = False
        self._closed = False
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="lmcache-p2p-lookup")
        self._thread.start()

    def _alive(self, address: str) -> str:
        return f"{self._prefix}lmcache:p2p:alive:{address}"

    def _keys(self, address: str) -> str:
        return f"{self._prefix}lmcache:p2p:keys:{address}"

    # ---- registrations ----------------------------------------------------------------------------

    def add(self, keys: Sequence[CacheEngineKey]) -> None:
        self._queue(keys, self._adds, self._removes, held=True)

    def remove(self, keys: Sequence[CacheEngineKey]) -> None:
        self._queue(keys, self._removes, self._adds, held=False)

    def _queue(self, keys: Sequence[CacheEngineKey], into: dict[str, None], other: dict[str, None],
               held: bool) -> None:
        with self._cond:
            for key in keys:
                s = key.to_string()
                other.pop(s, None)
                self._keep(s, into)
                if held:
                    self._held[s] = None
                else:
                    self._held.pop(s, None)
            self._cond.notify()

    def _keep(self, name: str, into: dict[str, None]) -> None:
        """Queue `name` in `into` (under `_cond`), unless `into` is full: counted in `num_dropped`."""
        if name in into or len(into) < MAX_QUEUED:
            into[name] = None
        else:
            self.num_dropped += 1

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued registration was sent (or failed); False on timeout."""
        with self._cond:
            self._cond.notify()
            return self._cond.wait_for(lambda: not (self._adds or self._removes or self._sending), timeout)

    def _run(self) -> None:
        beat_every = self.ttl_ms / 3000
        next_beat = retry_at = 0.0
        while True:
            with self._cond:
                wait = max(0.0, next_beat - _now())
                if _now() >= retry_at:
                    self._cond.wait_for(lambda: self._closed or self._adds or self._removes, wait)
                else:  # the last attempt failed: registrations wait for the retry time
                    self._cond.wait_for(lambda: self._closed, min(wait, retry_at - _now()))
                if self._closed:
                    return
                adds, self._adds = list(self._adds), {}
                removes, self._removes = list(self._removes), {}
                self._sending = True
            beat = _now() >= next_beat
            lost = self._send(adds, removes, beat)
            sent = lost is not None
            with self._cond:
                if lost and self._registered:  # the store forgot this instance: publish all it holds
                    for name in self._held:
                        if name not in self._removes:
                            self._keep(name, self._adds)
                self._registered = self._registered or bool(sent and (beat or adds))
                if not sent:  # keep them for the next attempt, unless superseded meanwhile
                    for name in adds:
                        if name not in self._removes:
                            self._keep(name, self._adds)
                    for name in removes:
                        if name not in self._adds:
                            self._keep(name, self._removes)
                    retry_at = _now() + beat_every
                if beat or not sent:
                    next_beat = _now() + beat_every
                self._sending = False
                self._cond.notify_all()

    def _send(self, adds: list[str], removes: list[str], beat: bool) -> bool | None:
        """One pipeline of registrations (and the heartbeat); None if it failed, else whether the
        heartbeat found this instance's ``alive`` entry gone."""
        keys = self._keys(self.address)
        pipe = self.client.pipeline(transaction=False)
        if adds:
            pipe.sadd(keys, *adds)
        if removes:
            pipe.srem(keys, *removes)
        alive_at = None  # the reply saying whether the heartbeat's entry was still there
        if beat or adds:
            pipe.sadd(self._instances, self.address)
            alive_at = len(pipe)
            pipe.exists(self._alive(self.address))  # (SET's GET option needs Redis 6.2)
            pipe.set(self._alive(self.address), b"1", px=self.ttl_ms)
            pipe.pexpire(keys, self.ttl_ms)

        def send() -> bool:
            replies = pipe.execute()
            return alive_at is not None and not replies[alive_at]

        return self._store.call(STORE, send, None)

    # ---- queries ----------------------------------------------------------------------------------

    def holders(self, keys: Sequence[CacheEngineKey]) -> list[list[str]]:
        """Per key, the addresses of the other live instances that hold it."""
        out: list[list[str]] = [[] for _ in keys]
        if not keys:
            return []
        nobody: tuple[list[str], list[Any]] = ([], [])
        peers, replies = self._store.call(STORE, lambda: self._ask_holders(keys), nobody)
        dead = []
        for peer, alive, members in zip(peers, replies[0::2], replies[1::2], strict=True):
            if not alive:
                dead.append(peer)
                continue
            for i, member in enumerate(members):
                if member:
                    out[i].append(peer)
        if dead:
            self._forget(dead)
        return out

    def _ask_holders(self, keys: Sequence[CacheEngineKey]) -> tuple[list[str], list[Any]]:
        """The live candidates, and per candidate its heartbeat and which of `keys` it holds."""
        peers = self._live_candidates()
        if not peers:
            return [], []
        names = [k.to_string() for k in keys]
        pipe = self.client.pipeline(transaction=False)
        for peer in peers:
            pipe.exists(self._alive(peer))
            pipe.smismember(self._keys(peer), names)
        return peers, pipe.execute()

    def _live_candidates(self) -> list[str]:
        now = _now()
        if now - self._peers_at > self.ttl_ms / 3000:
            members = {_text(m) for m in self.client.smembers(self._instances)}
            self._peers = sorted(members - {self.address})
            self._peers_at = now
        return self._peers

    def _forget(self, dead: list[str]) -> None:
        """Drop instances whose heartbeat expired from the instance list (their keys expired)."""
        try:
            self.client.srem(self._instances, *dead)
        except Exception as e:  # noqa: BLE001 - tidying only
            logger.debug("could not drop dead peers %s: %s", dead, e)
        self._peers = [p for p in self._peers if p not in dead]

    @property
    def peers(self) -> list[str]:
        """The other instances alive at the last look (`holders` refreshes it; nothing is asked)."""
        return list(self._peers)

    @property
    def healthy(self) -> bool:
        return not self._store.failing()

    def fault_counts(self) -> dict[str, float]:
        """``failures`` and ``skipped`` calls to the store."""
        return self._store.counts(STORE)

    def close(self) -> None:
        """Stop the heartbeat and withdraw this instance's registrations (best effort)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(5)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.srem(self._instances, self.address)
            pipe.delete(self._alive(self.address))
            pipe.delete(self._keys(self.address))
            pipe.execute()
        except Exception as e:  # noqa: BLE001 - the entries expire by themselves anyway
            logger.debug("could not withdraw %s from the lookup service: %s", self.address, e)
        self._connector.close()


def _now() -> float:
    return time.monotonic()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
