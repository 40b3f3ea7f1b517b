"""LMCache: a KV-cache layer for LLM serving engines.

Stores the KV caches an engine computes (CPU memory, local disk, remote stores), finds them again
by chunked prefix hashes, and loads them back so a repeated context costs a copy, not a prefill.
"""

import logging
import os

__version__ = "0.1.0"

_level = os.environ.get("LMCACHE_LOG_LEVEL")
if _level:
    logging.getLogger("lmcache").setLevel(_level.upper())
