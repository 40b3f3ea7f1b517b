"""Seed path alias of `lmcache.gpu_connector`."""

from lmcache.gpu_connector import *  # noqa: F403
