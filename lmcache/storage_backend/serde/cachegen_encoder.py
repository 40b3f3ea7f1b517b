"""Seed path alias of `lmcache.cachegen.encoder` (and `lmcache.cachegen.serde.CacheGenSerializer`)."""

from lmcache.cachegen.encoder import *  # noqa: F403
from lmcache.cachegen.serde import CacheGenSerializer  # noqa: F401
