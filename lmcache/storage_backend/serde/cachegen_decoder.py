"""Seed path alias of `lmcache.cachegen.decoder` (and `lmcache.cachegen.serde.CacheGenDeserializer`)."""

from lmcache.cachegen.decoder import *  # noqa: F403
from lmcache.cachegen.serde import CacheGenDeserializer  # noqa: F401
