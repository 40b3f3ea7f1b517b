"""Seed path alias of `lmcache.cachegen.config` and `lmcache.cachegen.encoded`."""

from lmcache.cachegen.config import *  # noqa: F403
from lmcache.cachegen.encoded import *  # noqa: F403
