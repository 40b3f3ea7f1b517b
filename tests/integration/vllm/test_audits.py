"""Self-verification (`verify_rate`) in real vLLM-CPU engines of the test families
(`tests.helpers.tiny_models`), on this CPU's kernel build.

Two engines: Llama with the hot tier and a Valkey remote tier, every lookup audited; Gemma 3
(sliding window) with the hot tier, every other lookup audited, and a wrong layout planted later.

- Audits of prompts stored by an earlier request find no mismatch (both), also where vLLM's own
  prefix cache makes the audited prefill split the prompt otherwise than the one that stored it.
- A byte flipped in a chunk of the remote tier (written through the tier's own API, so its checksum
  is valid) is a mismatch of that tier at the next audit; the chunk is deleted there, and with the
  hot tier cleared the prefix is no longer served past it.
- A wrong layout planted on one layer of the store copy (`tests.helpers.planted_faults`) is a
  mismatch naming that layer; after `verify_max_mismatches` the engine stops serving hits (one
  message), answers as without a cache, and audits go on.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from lmcache.integration.vllm.lookup_channel import LookupClient, socket_path
from tests.helpers import WRITE_WAIT
from tests.helpers.kernel_builds import environment
from tests.helpers.planted_faults import wrong_layout_env
from tests.helpers.servers import Valkey
from tests.helpers.tiny_models import ARCHS, tiny_model_path
from tests.helpers.vllm_engines import lmcache_transfer_config, sentence_text, start_llm, stderr_to, stop_llm

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

CHUNK = 256
LENGTH = 600  # two whole chunks and a partial one
SPLIT = 200  # a prompt whose first block (128 tokens) vLLM's own prefix cache then serves


class Engine:
    """A vLLM engine with LMCache and its lookup channel."""

    def __init__(self, arch: str, log: Path, env: dict[str, str] | None = None, trigger: Path | None = None,
                 **lmcache: Any) -> None:
        self.trigger = trigger  # the planted fault's switch (`planted_faults.wrong_layout_env`)
        self.model = tiny_model_path(arch)
        transfer = lmcache_transfer_config(**lmcache)
        with environment(env or {}), stderr_to(str(log)):
            self.llm = start_llm(transfer, dtype=ARCHS[arch].dtype, model=self.model)
        self.client = LookupClient([socket_path(self.llm.llm_engine.vllm_config, 0)], timeout=10)
        self.log = log

    def prompt(self, seed: int, length: int = LENGTH) -> list[int]:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.model)
        return tok(sentence_text(seed, 800), add_special_tokens=False).input_ids[:length]

    def run(self, ids: list[int]) -> tuple[list[int], list[float], int]:
        """Greedy tokens and logprobs of 3 steps, and the tokens served from a cache; vLLM's own
        prefix cache is reset first."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.llm.reset_prefix_cache()
        (out,) = self.llm.generate([TokensPrompt(prompt_token_ids=ids)],
                                   SamplingParams(max_tokens=3, temperature=0, logprobs=1), use_tqdm=False)
        comp = out.outputs[0]
        return (list(comp.token_ids), [s[t].logprob for s, t in zip(comp.logprobs, comp.token_ids)],
                out.num_cached_tokens)

    def stats(self) -> dict[str, Any]:
        (stats,) = self.client.stats()
        assert stats is not None
        return stats

    def audits(self, at_least: int) -> dict[str, Any]:
        """The audit report once `at_least` audits are counted and none is queued (bounded wait)."""
        deadline = time.monotonic() + 120
        while True:
            report = self.stats()["audits"]
            done = sum(n for kinds in report["counts"].values() for r in kinds.values() for n in r.values())
            if (done >= at_least and report["queued_bytes"] == 0) or time.monotonic() > deadline:
                return report
            time.sleep(0.2)

    def close(self) -> None:
        self.client.close()
        stop_llm(self.llm, wait=False)


def totals(report: dict[str, Any], tier: str) -> dict[str, int]:
    """{result: n} of one tier over group kinds."""
    out: dict[str, int] = {}
    for results in report["counts"].get(tier, {}).values():
        for result, n in results.items():
            out[result] = out.get(result, 0) + n
    return out


@pytest.fixture(scope="module")
def valkey(tmp_path_factory):
    server = Valkey(tmp_path_factory.mktemp("valkey")).start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def llama(valkey, tmp_path_factory):
    engine = Engine("llama", tmp_path_factory.mktemp("logs") / "engine.log", verify_rate=1.0,
                    max_local_cpu_size=0.25, remote_url=valkey.url)
    yield engine
    engine.close()


def audited_twice(engine: Engine, seed: int) -> tuple[Any, Any, Any]:
    """A prompt's cold run, its audited repeat, and an audited repeat split otherwise (vLLM's own
    prefix cache serving its first block after a shorter prompt)."""
    ids = engine.prompt(seed)
    cold = engine.run(ids)
    again = engine.run(ids)
    engine.run(ids[:SPLIT])  # leaves its first block in vLLM's prefix cache
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    (split,) = engine.llm.generate([TokensPrompt(prompt_token_ids=ids)],
                                   SamplingParams(max_tokens=3, temperature=0, logprobs=1), use_tqdm=False)
    return cold, again, split


def check_no_mismatch(engine: Engine, seed: int, tiers: tuple[str, ...]) -> dict[str, Any]:
    cold, again, split = audited_twice(engine, seed)
    assert again == cold  # the audited request is answered as a miss: a cold prefill, the same one
    assert again[2] == 0
    assert split.num_cached_tokens == 128  # vLLM's own first block only: LMCache answered a miss
    # chunks 0-2 of the repeat, chunks 1-2 of the split one (chunk 0 came from vLLM's prefix cache)
    report = engine.audits(len(tiers) * 5)
    for tier in tiers:
        counts = totals(report, tier)
        assert counts.get("mismatch", 0) == 0, report
        assert sum(counts.values()) >= 5, report
    assert not report["stopped"] and report["dropped"] == 0
    return report


def test_audits_of_llama_find_no_mismatch_in_either_tier(llama):
    check_no_mismatch(llama, 1, ("Hot", "RemoteBackend"))


def test_a_flipped_byte_in_the_remote_tier_is_a_mismatch_deleted_there_and_not_served_again(llama, valkey):
    import torch

    from lmcache.cache_key import CacheEngineKey
    from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
    from lmcache.memory_management import MixedMemoryAllocator
    from lmcache.storage_backend.remote_backend import RemoteBackend
    from lmcache.token_database import ChunkedTokenDatabase

    ids = llama.prompt(2)
    cold = llama.run(ids)
    config = LMCacheEngineConfig.from_defaults(remote_url=valkey.url)
    # the engine's keys of this prompt: its chunk hashes, the other fields from a stored key
    hashes = ChunkedTokenDatabase(config, LMCacheEngineMetadata("m", 1, 0, "vllm", torch.float32,
                                                                (1, 2, CHUNK, 1, 1))).chunk_hashes(
        torch.tensor(ids))
    import redis

    deadline = time.monotonic() + 60
    while True:  # the remote tier is written in the background
        stored = {CacheEngineKey.from_string(k.decode()) for k in redis.Redis(port=valkey.port).keys("*")}
        mine = {k.chunk_hash: k for k in stored if k.chunk_hash in hashes}
        if len(mine) == len(hashes) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(mine) == len(hashes) == 3
    key = mine[hashes[1]]
    alloc = MixedMemoryAllocator(64 << 20)
    tier = RemoteBackend(config, LMCacheEngineMetadata("m", 1, 0, "vllm", torch.float32, (1, 2, CHUNK, 1, 1)),
                         alloc.allocate)
    obj = tier.get_blocking(key)
    assert obj is not None and obj.tensor is not None
    obj.tensor[0, 2, 100].view(torch.uint8)[22] ^= 0x40  # a high mantissa bit of one K value of layer 2
    assert tier.remove(key)
    tier.submit_put_task(key, obj)  # the tier serializes it: a valid checksum over the flipped byte
    obj.ref_count_down()
    assert tier.puts.flush(WRITE_WAIT)
    before = llama.audits(0)
    assert llama.run(ids) == cold  # audited: a cold prefill
    report = llama.audits(sum(sum(totals(before, t).values()) for t in ("Hot", "RemoteBackend")) + 6)
    mismatches = totals(report, "RemoteBackend").get("mismatch", 0) - totals(before, "RemoteBackend").get(
        "mismatch", 0)
    assert mismatches == 1, report
    assert totals(report, "Hot").get("mismatch", 0) == 0  # the hot tier's copy is right
    assert not tier.contains(key)  # deleted from the tier that held the flipped byte
    text = llama.log.read_text(errors="replace")
    assert text.count("audit mismatch:") == 1 and "layer 2 (" in text and "tier RemoteBackend" in text
    assert llama.client.clear("hot")
    hits = llama.stats()["engine"]["lookup_hit_tokens"]
    llama.client.lookup("probe-after-flip", ids, None)  # audited (rate 1): the engine counts what it holds
    assert llama.stats()["engine"]["lookup_hit_tokens"] - hits == CHUNK  # chunk 0 only: chunk 1 is gone
    tier.close()


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """Gemma 3 (sliding window) at rate 0.5 from seed 0: lookups 1, 3, 5... are audited, 0, 2,
    4... served; a wrong layout planted on layer 1 once the file `trigger` exists."""
    folder = tmp_path_factory.mktemp("gemma3")
    trigger = folder / "plant-wrong-layout"
    engine = Engine("gemma3", folder / "engine.log", env=wrong_layout_env(1, trigger), trigger=trigger,
                    verify_rate=0.5, verify_seed=0, verify_max_mismatches=2, max_local_cpu_size=0.25)
    yield engine
    engine.close()


def test_audits_of_another_family_find_no_mismatch(gemma3):
    # lookups: 0 cold, 1 the repeat (audited), 2 the shorter prompt (nothing cached), 3 the split
    # one (audited)
    check_no_mismatch(gemma3, 3, ("Hot",))


def test_a_wrong_layout_is_a_mismatch_and_max_mismatches_stops_hits_while_the_engine_serves_on(gemma3):
    assert gemma3.trigger is not None
    gemma3.trigger.touch()  # from now on layer 1 is stored in a wrong layout
    before = totals(gemma3.audits(0), "Hot")
    ids = gemma3.prompt(4)
    cold = gemma3.run(ids)  # lookup 4: nothing cached; stored
    assert gemma3.run(ids) == cold  # lookup 5: audited
    report = gemma3.audits(sum(before.values()) + 3)
    assert totals(report, "Hot").get("mismatch", 0) == 3, report  # every chunk
    text = gemma3.log.read_text(errors="replace")
    assert text.count("audit mismatch:") == 3 and text.count("layer 1 (") == 3
    assert report["stopped"] and text.count("stops serving cache hits") == 1
    assert gemma3.run(ids) == cold  # lookup 6 would be served: hits stopped, computed cold
    assert gemma3.run(ids) == cold  # lookup 7: audited again (stores went on)
    report = gemma3.audits(sum(before.values()) + 6)
    assert totals(report, "Hot").get("mismatch", 0) == 6, report
    assert gemma3.log.read_text(errors="replace").count("stops serving cache hits") == 1
