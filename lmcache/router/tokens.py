"""The prompt's token ids as the engine will see them, from the model's own tokenizer, and the keys
its blocks are hashed with besides (`request_keys`).

A completion's ``prompt`` (text, or token ids already) is tokenized like vLLM's completion endpoint
does (special tokens added as the tokenizer adds them); a chat's ``messages`` are rendered with the
tokenizer's chat template (``add_generation_prompt``) and the text tokenized without adding special
tokens, as vLLM's chat endpoint does. None for a body the router cannot tokenize (a batch of
prompts, multimodal parts, a custom template, messages the template cannot render, token ids out
of range): such a request is routed as a miss, and the engine judges it.
"""

from __future__ import annotations

import logging
from typing import Any

from lmcache.router.events import MAX_TOKEN_ID
from lmcache.router.index import RequestKeys

logger = logging.getLogger(__name__)


def request_keys(body: dict[str, Any]) -> RequestKeys:
    """What keys the request's cache besides its tokens: its ``cache_salt`` (vLLM's request field)
    and its ``model`` (a LoRA adapter's name, where it names one)."""
    salt, model = body.get("cache_salt"), body.get("model")
    return RequestKeys(salt if isinstance(salt, str) else None, model if isinstance(model, str) else None)


class PromptTokenizer:
    def __init__(self, model: str) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(model)

    def __call__(self, path: str, body: dict[str, Any]) -> list[int] | None:
        try:
            return self._tokens(path, body)
        except Exception:  # a template (Jinja) or tokenizer refusing the body raises anything
            logger.debug("a %s body the tokenizer cannot read: routed as a miss", path, exc_info=True)
            return None

    def _tokens(self, path: str, body: dict[str, Any]) -> list[int] | None:
        if path.endswith("/chat/completions"):
            messages = body.get("messages")
            if not isinstance(messages, list) or body.get("chat_template") is not None or not all(
                    isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
                return None
            text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return list(self._tok(text, add_special_tokens=False).input_ids)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return list(self._tok(prompt).input_ids)
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and 0 <= t < MAX_TOKEN_ID for t in prompt):
            return prompt
        return None
