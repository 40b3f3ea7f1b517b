"""The lm:// cache server (`lmcache server`) and its client: a shared key -> bytes store."""
