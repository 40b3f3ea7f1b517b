"""Seed path alias of `lmcache.cachegen.encoder`."""

from lmcache.cachegen.encoder import *  # noqa: F403
