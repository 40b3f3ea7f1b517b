"""Seed path alias of `lmcache.token_database` (part of the compat edge)."""

from lmcache.token_database import *  # noqa: F403
