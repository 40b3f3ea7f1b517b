"""Seed path alias of `lmcache.token_database`."""

from lmcache.token_database import *  # noqa: F403
