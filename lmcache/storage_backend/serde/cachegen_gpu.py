"""Seed path alias of `lmcache.cachegen.gpu`."""

from lmcache.cachegen.gpu import *  # noqa: F403
