"""The prompt's token ids as the engine will see them, from the model's own tokenizer.

A completion's ``prompt`` (text, or token ids already) is tokenized like vLLM's completion endpoint
does (special tokens added as the tokenizer adds them); a chat's ``messages`` are rendered with the
tokenizer's chat template (``add_generation_prompt``) and the text tokenized without adding special
tokens, as vLLM's chat endpoint does. None for a body the router cannot tokenize (a batch of
prompts, multimodal parts, a custom template, token ids out of range): such a request is routed
as a miss.
"""

from __future__ import annotations

from typing import Any

from lmcache.chunk_hash import extra_key_of
from lmcache.router.events import MAX_TOKEN_ID


def extra_key(body: dict[str, Any]) -> str | None:
    """What seeds the request's LMCache chunk hashes as its engine computes them: its ``cache_salt``
    (vLLM's request field). A LoRA adapter seeds them too, but the router does not know adapter ids:
    a LoRA request is matched as the base model's (a shared server's prefix is over-estimated)."""
    salt = body.get("cache_salt")
    return extra_key_of(salt if isinstance(salt, str) else None)


class PromptTokenizer:
    def __init__(self, model: str) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(model)

    def __call__(self, path: str, body: dict[str, Any]) -> list[int] | None:
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
