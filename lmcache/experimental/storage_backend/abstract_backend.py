"""Seed path alias of `lmcache.storage_backend.abstract_backend` (part of the compat edge)."""

from lmcache.storage_backend.abstract_backend import *  # noqa: F403
