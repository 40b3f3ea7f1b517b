"""`lmcache router`: one OpenAI-compatible front for several vLLM instances (see `server`)."""
