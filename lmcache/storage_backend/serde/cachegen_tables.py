"""Seed path alias of `lmcache.cachegen.tables`."""

from lmcache.cachegen.tables import *  # noqa: F403
