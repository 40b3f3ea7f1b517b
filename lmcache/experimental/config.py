"""Seed path alias of `lmcache.config`."""

from lmcache.config import *  # noqa: F403
