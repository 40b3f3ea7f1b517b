"""`lmcache verify`: a canary that asks a running OpenAI-compatible server each prompt as it is
(served from its caches) and with a fresh random ``cache_salt`` (computed), and judges the two
greedy answers within the dtype's rounding (`run` orchestrates and reports, `judge` compares,
`prompts` reads or generates the prompts, `openai_client` talks to the server)."""
