"""Seed path alias of `lmcache.cachegen.config`."""

from lmcache.cachegen.config import *  # noqa: F403
