"""Seed path alias of `lmcache.cachegen.config` and `lmcache.cachegen.encoded` (the seed's method
`CacheGenGPUEncoderOutput.debug_print_device` comes from `lmcache.compat.cachegen_seed`)."""

from lmcache.cachegen.config import *  # noqa: F403
from lmcache.cachegen.encoded import *  # noqa: F403
from lmcache.compat.cachegen_seed import debug_print_device  # noqa: F401
