"""Seed path alias of `lmcache.cachegen.format`."""

from lmcache.cachegen.format import *  # noqa: F403
