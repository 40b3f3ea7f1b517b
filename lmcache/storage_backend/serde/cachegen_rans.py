"""Seed path alias of `lmcache.cachegen.rans`."""

from lmcache.cachegen.rans import *  # noqa: F403
