"""Prefill/decode disaggregation: one vLLM instance prefills, another decodes, LMCache moves the KV.

- `proxy`: the OpenAI-compatible front (`lmcache proxy`) that sends each request to a prefiller
  with ``max_tokens=1``, then to a decoder, and streams the decoder's answer back.
"""
