"""The prompts `lmcache verify` asks: read from a file, or cut from real text with the server's own
tokenizer to exact token lengths.

- A prompts file: one prompt per line (empty lines skipped), or, for a ``.jsonl`` file, one JSON
  object per line with ``"prompt"`` (text) or ``"tokens"`` (token ids) and an optional ``"name"``.
- Generated: the corpus files' text is tokenized by the server (``/tokenize``, no special
  tokens); prompt i of n is the ``length`` tokens starting i/n of the way through it (so no two
  share a prefix), sent as token ids; ``/detokenize`` gives its text for the report.

Bad input raises `PromptError` with the file and line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lmcache.verify.openai_client import OpenAIClient


class PromptError(ValueError):
    """A prompts file or corpus that cannot be used."""


@dataclass
class Prompt:
    name: str
    prompt: str | list[int]  # text, or token ids
    preview: str  # the start of its text, for the report


def _preview(text: str, width: int = 40) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def load_prompts(path: str) -> list[Prompt]:
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PromptError(f"cannot read the prompts file {path}: {e}") from None
    jsonl = path.endswith(".jsonl")
    prompts = [_jsonl_prompt(path, n, line) if jsonl else Prompt(f"line {n}", line, _preview(line))
               for n, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise PromptError(f"the prompts file {path} holds no prompt")
    return prompts


def _jsonl_prompt(path: str, n: int, line: str) -> Prompt:
    where = f"{path} line {n}"
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise PromptError(f"{where}: not JSON ({e})") from None
    if not isinstance(item, dict) or ("prompt" in item) == ("tokens" in item):
        raise PromptError(f'{where}: must be an object with "prompt" (text) or "tokens" (token ids)')
    name = str(item.get("name", f"line {n}"))
    if "prompt" in item:
        text = item["prompt"]
        if not isinstance(text, str) or not text:
            raise PromptError(f'{where}: "prompt" must be a non-empty string')
        return Prompt(name, text, _preview(text))
    tokens = item["tokens"]
    if not isinstance(tokens, list) or not tokens or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        raise PromptError(f'{where}: "tokens" must be a non-empty list of token ids')
    return Prompt(name, tokens, f"{len(tokens)} token ids")


def generate_prompts(client: OpenAIClient, model: str, corpus: list[str], lengths: list[int]) -> list[Prompt]:
    """One prompt of each of `lengths` tokens, cut from the text of the `corpus` files."""
    if not lengths or min(lengths) < 1:
        raise PromptError(f"prompt lengths must be >= 1 token, got {lengths}")
    try:
        text = "\n\n".join(Path(p).read_text() for p in corpus)
    except (OSError, UnicodeDecodeError) as e:
        raise PromptError(f"cannot read the corpus: {e}") from None
    ids = client.tokenize(model, text) if text.strip() else []
    if len(ids) < max(lengths):
        raise PromptError(f"the corpus ({', '.join(corpus)}) has {len(ids)} tokens; "
                          f"the longest prompt asks {max(lengths)}")
    prompts = []
    for i, length in enumerate(lengths):
        start = i * len(ids) // len(lengths)
        tokens = (ids[start:] + ids[:start])[:length]
        prompts.append(Prompt(f"{length} tokens @{start}", tokens,
                              _preview(client.detokenize(model, tokens))))
    return prompts
