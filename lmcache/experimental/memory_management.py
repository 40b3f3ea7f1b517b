"""Seed path alias of `lmcache.memory_management` (part of the compat edge)."""

from lmcache.memory_management import *  # noqa: F403
