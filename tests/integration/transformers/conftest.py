"""Fixtures for the transformers integration tests: the real SmolLM2-135M-Instruct (fp32) and
small real engines for it."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForCausalLM, AutoTokenizer

from lmcache.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.config import LMCacheEngineConfig
from lmcache.integration.local_model import local_model_path
from lmcache.integration.transformers import create_hf_engine

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def smollm() -> tuple[Any, Any]:
    """(model, tokenizer) of the local SmolLM2-135M-Instruct in float32."""
    path = local_model_path("float32")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


@pytest.fixture
def make_engine(smollm: tuple[Any, Any],
                request: pytest.FixtureRequest) -> Iterator[Callable[..., LMCacheEngine]]:
    """Builds real engines for the model (64-token chunks, 64 MB hot tier) with config overrides."""
    made: list[str] = []

    def make(**overrides: Any) -> LMCacheEngine:
        kw: dict[str, Any] = {"chunk_size": 64, "max_local_cpu_size": 0.0625, **overrides}
        instance = f"it-{request.node.name}-{len(made)}"
        made.append(instance)
        return create_hf_engine(smollm[0], LMCacheEngineConfig.from_defaults(**kw), instance_id=instance)

    yield make
    for instance in made:
        LMCacheEngineBuilder.destroy(instance)


class ForwardTokenCounter:
    """Counts the tokens each forward of the model's decoder actually receives."""

    def __init__(self, model: Any) -> None:
        self.calls: list[int] = []
        self._handle = model.model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = args[0] if args else kwargs["inputs_embeds"]
        self.calls.append(int(ids.shape[1]))

    def take(self) -> list[int]:
        calls, self.calls = self.calls, []
        return calls

    def close(self) -> None:
        self._handle.remove()


@pytest.fixture
def forward_tokens(smollm: tuple[Any, Any]) -> Iterator[ForwardTokenCounter]:
    counter = ForwardTokenCounter(smollm[0])
    yield counter
    counter.close()
