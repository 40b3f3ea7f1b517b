"""Seed path alias of `lmcache.cachegen.quant`."""

from lmcache.cachegen.quant import *  # noqa: F403
