"""`PrefixCacheLM` through each copy path of its token-major connector: the CPU default, the staged
path forced on the CPU (``LMCACHE_STAGED_COPY=1``) and CUDA (where present). A repeat loads exactly
the KV the first prefill stored and computes only the last token."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from lmcache.cache_engine import LMCacheEngineBuilder
from lmcache.config import LMCacheEngineConfig
from lmcache.integration.transformers import PrefixCacheLM, create_hf_engine


@pytest.mark.parametrize("mode", ["cpu", "cpu-staged", "cuda"])
def test_a_repeat_loads_the_stored_kv_bit_for_bit(tiny_llama: Any, mode: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if mode == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setenv("LMCACHE_STAGED_COPY", "1" if mode == "cpu-staged" else "0")
    model = tiny_llama if mode != "cuda" else copy.deepcopy(tiny_llama).to("cuda", torch.bfloat16)
    instance = f"paths-{mode}"
    config = LMCacheEngineConfig.from_defaults(chunk_size=16, max_local_cpu_size=0.01)
    engine = create_hf_engine(model, config, instance_id=instance)
    try:
        assert engine.gpu_connector.staged == (mode == "cpu-staged")  # type: ignore[attr-defined]
        lm = PrefixCacheLM(model, engine)
        ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(1))
        first = lm.prefill(ids)
        assert (first.num_cached_tokens, first.num_computed_tokens) == (0, 70)
        assert engine.gpu_connector.drain(30)  # type: ignore[attr-defined]
        second = lm.prefill(ids)
        assert (second.num_cached_tokens, second.num_computed_tokens) == (69, 1)
        for a, b in zip(first.past_key_values.layers, second.past_key_values.layers):
            assert torch.equal(a.keys[:, :, :69], b.keys[:, :, :69])  # type: ignore[index]
            assert torch.equal(a.values[:, :, :69], b.values[:, :, :69])  # type: ignore[index]
        tol = 1e-4 if mode != "cuda" else 5e-2
        torch.testing.assert_close(second.logits.float(), first.logits.float(), atol=tol, rtol=tol)
    finally:
        LMCacheEngineBuilder.destroy(instance)


def test_two_engines_on_a_cache_server_share_a_prefill(tiny_llama: Any, tmp_path: Any) -> None:
    """The HF integration on a cache server (`cache_server_url`): a prefill one engine stored is
    loaded bit for bit by another engine that never saw it."""
    import threading

    from lmcache.cache_server.server import CacheServer

    url = f"ipc://{tmp_path}/cache.sock"
    server = CacheServer(url, 16 << 20)
    loop = threading.Thread(target=server.serve_forever)
    loop.start()
    config = LMCacheEngineConfig.from_defaults(chunk_size=16, cache_server_url=url)
    try:
        one = PrefixCacheLM(tiny_llama, create_hf_engine(tiny_llama, config, instance_id="server-one"))
        two = PrefixCacheLM(tiny_llama, create_hf_engine(tiny_llama, config, instance_id="server-two"))
        ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(2))
        first = one.prefill(ids)
        assert (first.num_cached_tokens, first.num_computed_tokens) == (0, 70)
        assert one.engine.gpu_connector.drain(30)  # type: ignore[attr-defined]
        # The commit is a one-way message: engine one's next request, on the same socket, is
        # answered after it; engine two's, on its own socket, might have been answered before.
        assert one.engine.lookup(ids[0]) == 70
        second = two.prefill(ids)
        assert (second.num_cached_tokens, second.num_computed_tokens) == (69, 1)
        for a, b in zip(first.past_key_values.layers, second.past_key_values.layers):
            assert torch.equal(a.keys[:, :, :69], b.keys[:, :, :69])  # type: ignore[index]
            assert torch.equal(a.values[:, :, :69], b.values[:, :, :69])  # type: ignore[index]
        torch.testing.assert_close(second.logits, first.logits, atol=1e-4, rtol=1e-4)
        assert server.stats()["arena"]["used_bytes"] > 0
    finally:
        LMCacheEngineBuilder.destroy("server-one")
        LMCacheEngineBuilder.destroy("server-two")
        server.stop()
        loop.join()
        server.close()
