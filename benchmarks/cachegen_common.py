"""Shared plumbing of the CacheGen benchmarks: the local SmolLM2 model, KV of real text, next-token
distributions on top of a (decoded) KV cache, and the quality metrics.

Texts (benchmarks/data/, sources and licenses in benchmarks/data/README.md), one set for fitting
the bin tables (`cachegen_calibrate.py`) and a separate one for evaluation (`cachegen_quality.py`),
each spanning six genres: prose, dialogue, source code, legal/technical text, non-English text,
numbers/tables.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DATA = Path(__file__).with_name("data")
EVAL = (
    ("prose", "moby_dick_ch1.txt"),
    ("prose", "alice_ch1.txt"),
    ("prose", "pride_and_prejudice_ch1_2.txt"),
    ("dialogue", "genres/eval_earnest_act1.txt"),
    ("code", "genres/eval_textwrap_py.txt"),
    ("legal/technical", "genres/eval_apache_2_0_license.txt"),
    ("legal/technical", "genres/eval_apt_get_man.txt"),
    ("non-English", "genres/eval_de_grimm_haensel_und_gretel.txt"),
    ("non-English", "genres/eval_fr_apt_cache_man.txt"),
    ("numbers/tables", "genres/eval_zone1970_tab.txt"),
)
FIT = (
    ("prose", "calibration_two_cities_carol.txt"),
    ("dialogue", "genres/fit_hamlet_1_1.txt"),
    ("code", "genres/fit_heapq_py.txt"),
    ("legal/technical", "genres/fit_gpl_3_license.txt"),
    ("non-English", "genres/fit_de_dpkg_buildpackage_man.txt"),
    ("numbers/tables", "genres/fit_numpy_log2_validation_csv.txt"),
)
EVAL_TEXTS = tuple(f for _, f in EVAL)
FIT_TEXTS = tuple(f for _, f in FIT)


@dataclass
class Prompt:
    name: str
    context: torch.Tensor  # [ctx] token ids
    continuation: torch.Tensor  # [nxt] token ids, teacher-forced after the context


class KVModel:
    """SmolLM2-135M (fp32) with helpers to get a context's KV and score a continuation on top
    of any KV cache. KV tensors are KV_BLOB-shaped: [2, L, T, num_kv_heads * head_dim]."""

    def __init__(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from lmcache.integration.local_model import local_model_path

        path = local_model_path("float32")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        cfg = self.model.config
        self.num_layers = cfg.num_hidden_layers
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    def prompt(self, file: str, ctx: int, nxt: int) -> Prompt:
        ids = self.tokenizer((DATA / file).read_text(), return_tensors="pt")["input_ids"][0]
        if len(ids) < ctx + nxt:
            raise ValueError(f"{file} has {len(ids)} tokens, need {ctx + nxt}")
        return Prompt(Path(file).name.removesuffix(".txt"), ids[:ctx], ids[ctx:ctx + nxt])

    @torch.no_grad()
    def kv_of(self, ids: torch.Tensor) -> torch.Tensor:
        cache = self.model(ids[None], use_cache=True).past_key_values
        def blob(t: torch.Tensor) -> torch.Tensor:  # [1, H, T, D] -> [T, H * D]
            return t[0].transpose(0, 1).reshape(t.shape[2], -1)
        keys = torch.stack([blob(cache.layers[i].keys) for i in range(self.num_layers)])
        values = torch.stack([blob(cache.layers[i].values) for i in range(self.num_layers)])
        return torch.stack([keys, values])

    def _cache(self, kv: torch.Tensor) -> Any:  # a transformers DynamicCache
        from transformers import DynamicCache

        cache = DynamicCache()
        ntok = kv.shape[2]
        for layer in range(self.num_layers):
            k, v = (kv[i, layer].float().reshape(ntok, self.kv_heads, self.head_dim)
                    .transpose(0, 1)[None].contiguous() for i in (0, 1))
            cache.update(k, v, layer)
        return cache

    @torch.no_grad()
    def next_logprobs(self, kv: torch.Tensor, continuation: torch.Tensor) -> torch.Tensor:
        """Log-probs [nxt, vocab] of the next token at each continuation position."""
        out = self.model(continuation[None], past_key_values=self._cache(kv), use_cache=True)
        return out.logits[0].float().log_softmax(-1)

    @torch.no_grad()
    def greedy(self, kv: torch.Tensor, first: torch.Tensor, n: int) -> list[int]:
        """n greedy tokens generated after `first` (one token id) on top of `kv`."""
        cache, token, out = self._cache(kv), first.reshape(1, 1), []
        for _ in range(n):
            logits = self.model(token, past_key_values=cache, use_cache=True).logits[0, -1]
            token = logits.argmax().reshape(1, 1)
            out.append(int(token))
        return out


def kl_and_top1(ref: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: KL(ref || other) in nats and whether the argmax agrees."""
    kl = (ref.exp() * (ref - logprobs)).sum(-1)
    return kl, (ref.argmax(-1) == logprobs.argmax(-1)).float()


def kv_8b_like(tokens: int, layers: int = 32, hidden: int = 1024) -> torch.Tensor:
    """KV_BLOB [2, layers, tokens, hidden] bf16 in an 8B-like shape made of real KV: SmolLM2's KV
    (30 layers x 192 channels) of `tokens` tokens of the evaluation texts, laid side by side —
    layer l, channels [192 j, 192 (j + 1)) hold SmolLM2 layer (l + 7 j) % 30 — so every channel
    has real statistics. Cached under benchmarks/out/ (computing it takes ~1 minute)."""
    cache = Path(__file__).with_name("out") / f"kv_8b_like_{tokens}_{layers}_{hidden}.pt"
    if cache.exists():
        return torch.load(cache)
    model = KVModel()
    text = "\n\n".join((DATA / f).read_text() for f in EVAL_TEXTS)
    ids = model.tokenizer(text, return_tensors="pt")["input_ids"][0]
    if len(ids) < tokens:
        raise ValueError(f"the evaluation texts have {len(ids)} tokens, need {tokens}")
    real = model.kv_of(ids[:tokens]).to(torch.bfloat16)  # [2, 30, tokens, 192]
    nreal, width = real.shape[1], real.shape[3]
    out = torch.empty(2, layers, tokens, hidden, dtype=torch.bfloat16)
    for layer in range(layers):
        for j in range(-(-hidden // width)):
            part = real[:, (layer + 7 * j) % nreal]
            end = min(hidden, (j + 1) * width)
            out[:, layer, :, j * width:end] = part[..., : end - j * width]
    cache.parent.mkdir(exist_ok=True)
    torch.save(out, cache)
    return out
