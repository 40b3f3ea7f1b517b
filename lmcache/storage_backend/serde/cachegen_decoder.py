"""Seed path alias of `lmcache.cachegen.decoder`, with `lmcache.cachegen.serde.CacheGenDeserializer`
and the seed's helpers from `lmcache.compat.cachegen_seed`."""

from lmcache.cachegen.decoder import *  # noqa: F403
from lmcache.cachegen.serde import CacheGenDeserializer  # noqa: F401
from lmcache.compat.cachegen_seed import (  # noqa: F401
    decode_chunk,
    decode_function_gpu,
    do_dequantize,
    quant,
)
