"""Seed path alias of `lmcache.cachegen.kernels`."""

from lmcache.cachegen.kernels import *  # noqa: F403
