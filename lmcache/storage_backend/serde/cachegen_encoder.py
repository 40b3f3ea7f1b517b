"""Seed path alias of `lmcache.cachegen.encoder`, with `lmcache.cachegen.serde.CacheGenSerializer` and
the seed's helpers from `lmcache.compat.cachegen_seed`."""

from lmcache.cachegen.encoder import *  # noqa: F403
from lmcache.cachegen.serde import CacheGenSerializer  # noqa: F401
from lmcache.compat.cachegen_seed import (  # noqa: F401
    collect_bytes,
    concat_max,
    encode_function,
    torch_quant,
    torch_quant_vectorized,
)
