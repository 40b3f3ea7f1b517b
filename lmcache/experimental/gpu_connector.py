"""Seed path alias of `lmcache.gpu_connector` (part of the compat edge)."""

from lmcache.gpu_connector import *  # noqa: F403
