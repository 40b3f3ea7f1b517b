"""Seed path alias of `lmcache.cachegen.decoder`."""

from lmcache.cachegen.decoder import *  # noqa: F403
