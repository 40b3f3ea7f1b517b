"""Seed path alias of `lmcache.config` (part of the compat edge)."""

from lmcache.config import *  # noqa: F403
