"""Seed path alias of `lmcache.cachegen.layout`."""

from lmcache.cachegen.layout import *  # noqa: F403
