"""The few calls `lmcache verify` makes to a vLLM OpenAI-compatible server (standard library only).

- ``GET /v1/models``: the served model's name.
- ``GET /server_info`` (vLLM's dev mode, ``VLLM_SERVER_DEV_MODE=1``): the engine config, read for
  the model's dtype; absent otherwise.
- ``POST /tokenize`` / ``/detokenize``: the server's own tokenizer.
- ``POST /reset_prefix_cache`` (dev mode): empty vLLM's own prefix cache.
- ``POST /v1/completions``: greedy, with ``logprobs``, token ids as ``token_id:N`` strings,
  ``ignore_eos`` (every answer has ``max_tokens`` steps) and optionally vLLM's ``cache_salt``.

Every failure is a `ServerError` whose message names the URL and what went wrong.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

_T = TypeVar("_T")


class ServerError(RuntimeError):
    """The server could not be reached or refused a request."""


@dataclass
class Completion:
    """One greedy completion: per generated step, the token id, its logprob and the top logprobs
    by token id (the chosen token included); `cached_tokens` is the usage's
    ``prompt_tokens_details.cached_tokens`` (None where the server does not report it)."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[dict[int, float]]
    prompt_tokens: int
    cached_tokens: int | None


class OpenAIClient:
    def __init__(self, base_url: str, timeout: float = 600.0) -> None:
        base = base_url if "://" in base_url else f"http://{base_url}"
        self.base_url = base.rstrip("/").removesuffix("/v1")
        self.timeout = timeout

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        url = f"{self.base_url}{path}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            raise ServerError(f"{method} {url}: HTTP {e.code}: {_error_text(e)}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ServerError(f"cannot reach {url}: {reason}") from None
        except json.JSONDecodeError as e:
            raise ServerError(f"{method} {url}: the answer is not JSON: {e}") from None

    def _ask(self, method: str, path: str, body: dict[str, Any] | None, read: Callable[[Any], _T]) -> _T:
        """`read` applied to the JSON answer; an answer it cannot read is a `ServerError`."""
        answer = self._call(method, path, body)
        try:
            return read(answer)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise ServerError(f"{self.base_url}{path}: unexpected answer ({e!r}): "
                              f"{json.dumps(answer)[:300]}") from None

    def model(self) -> str:
        """The name of the (first) model the server serves."""
        names = self._ask("GET", "/v1/models", None,
                          lambda answer: [str(m["id"]) for m in (answer.get("data") or [])[:1]])
        if not names:
            raise ServerError(f"{self.base_url}/v1/models lists no model")
        return names[0]

    def dtype(self) -> str | None:
        """The engine's model dtype (e.g. "float32") from vLLM's ``/server_info``; None where the
        server does not expose it (it needs ``VLLM_SERVER_DEV_MODE=1``)."""
        try:
            config = self._ask("GET", "/server_info", None, lambda info: str(info.get("vllm_config", "")))
        except ServerError:
            return None
        match = re.search(r"\bdtype=torch\.(\w+)", config)
        return match.group(1) if match else None

    def tokenize(self, model: str, text: str) -> list[int]:
        return self._ask("POST", "/tokenize", {"model": model, "prompt": text, "add_special_tokens": False},
                         lambda answer: [_count(t) for t in answer["tokens"]])

    def detokenize(self, model: str, tokens: list[int]) -> str:
        return self._ask("POST", "/detokenize", {"model": model, "tokens": tokens},
                         lambda answer: str(answer["prompt"]))

    def reset_prefix_cache(self, attempts: int = 20) -> None:
        """Empty vLLM's own prefix cache (vLLM refuses while blocks are in use: retried)."""
        for _ in range(attempts):
            try:
                if self._ask("POST", "/reset_prefix_cache", None, lambda answer: answer.get("success", True)):
                    return
            except ServerError as e:
                raise ServerError(f"{e} (the endpoint needs the server started with "
                                  "VLLM_SERVER_DEV_MODE=1)") from None
            time.sleep(0.25)
        raise ServerError(f"{self.base_url}/reset_prefix_cache kept answering success=false")

    def complete(self, model: str, prompt: str | list[int], max_tokens: int, top_logprobs: int,
                 cache_salt: str | None = None) -> Completion:
        body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": 0, "logprobs": top_logprobs, "ignore_eos": True,
                                "return_tokens_as_token_ids": True}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        return self._ask("POST", "/v1/completions", body, _completion)


def _completion(answer: Any) -> Completion:
    """The `Completion` of a ``/v1/completions`` answer; KeyError, ValueError, ... where it is not one
    (every step needs its token, logprob and top logprobs, and there is at least one step)."""
    logprobs = answer["choices"][0]["logprobs"]
    usage = answer["usage"]
    details = usage.get("prompt_tokens_details") or {}
    tokens = [_token_id(t) for t in logprobs["tokens"]]
    chosen = [float(x) for x in logprobs["token_logprobs"]]
    top = [{_token_id(t): float(x) for t, x in step.items()} for step in logprobs["top_logprobs"]]
    if not tokens or not len(tokens) == len(chosen) == len(top):
        raise ValueError(f"{len(tokens)} tokens, {len(chosen)} token_logprobs and {len(top)} "
                         "top_logprobs (expected as many, at least one)")
    cached = details.get("cached_tokens")
    return Completion(tokens, chosen, top, _count(usage["prompt_tokens"]),
                      None if cached is None else _count(cached))


def _count(value: Any) -> int:
    """`value` if it is a non-negative integer (a token id or count); ValueError otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return value


def _token_id(token: Any) -> int:
    if not isinstance(token, str) or not token.startswith("token_id:"):
        raise ValueError(f"token {token!r} is not a token id: the server ignored return_tokens_as_token_ids")
    return int(token.removeprefix("token_id:"))


def _error_text(e: urllib.error.HTTPError) -> str:
    raw = e.read().decode(errors="replace")
    try:
        error = json.loads(raw).get("error", raw)
        return str(error.get("message", error) if isinstance(error, dict) else error)[:500]
    except (json.JSONDecodeError, AttributeError):
        return raw[:500]
