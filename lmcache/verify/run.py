"""`lmcache verify`: a canary against a running vLLM OpenAI-compatible server, with any KV
connector (or none).

1. Warm-up (unless ``--no-warm``: the prompts were already served): each prompt is asked once, so
   that the server's caches hold it.
2. For each prompt: asked as it is (may be served from a cache; with ``--reset-prefix-cache``,
   vLLM's own prefix cache is emptied first so that the connector behind it serves it), then with
   a fresh random ``cache_salt`` (nothing cached can serve it: the reference). Both greedy,
   ``--max-tokens`` steps, ``--top-logprobs`` logprobs per step.
3. Judged by `lmcache.verify.judge` within the dtype's rounding, reported as a table (or
   ``--json``). Hit tokens are the usage's ``prompt_tokens_details.cached_tokens`` (vLLM's prefix
   cache and the connector together; the server needs ``--enable-prompt-tokens-details``, else
   "unknown"). A reference that was served from a cache all the same (a connector that ignores
   ``cache_salt``) makes the prompt ``unverified``.

Exit status: 0 every prompt equal (or a near tie within rounding), 1 a mismatch beyond rounding
(the prompts are named on stderr), 2 nothing to compare against (an unverified prompt, an
unreachable server, bad input).
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import sys
from dataclasses import asdict, dataclass
from typing import Any

from lmcache.verify.judge import MISMATCH, TOLERANCE, judge
from lmcache.verify.openai_client import OpenAIClient, ServerError
from lmcache.verify.prompts import Prompt, PromptError, generate_prompts, load_prompts

UNVERIFIED = "unverified"
HIT_SOURCE = "usage.prompt_tokens_details.cached_tokens (vLLM's prefix cache + the KV connector)"


@dataclass
class PromptResult:
    name: str
    preview: str
    prompt_tokens: int
    hit_tokens: int | None  # of the request as it is; None: the server does not report it
    reference_hit_tokens: int | None  # of the salted request (should be 0)
    tokens_equal: bool
    max_logprob_diff: float | None  # None: a token's logprob was beyond the other answer's top logprobs
    first_difference: int | None
    verdict: str  # EQUAL, TIE, MISMATCH or UNVERIFIED
    note: str


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    p.add_argument("--model", help="the served model name (default: the first in /v1/models)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts", metavar="FILE", help="prompts, one per line, or a .jsonl file of "
                        '{"prompt": text} / {"tokens": [ids]} objects (optional "name")')
    source.add_argument("--corpus", nargs="+", metavar="FILE",
                        help="text files to cut prompts of --lengths tokens from (the server's tokenizer)")
    p.add_argument("--lengths", default="256,1024",
                   help="with --corpus: comma-separated prompt lengths in tokens (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=8, help="greedy steps per answer (default %(default)s)")
    p.add_argument("--top-logprobs", type=int, default=5,
                   help="logprobs per step, to judge a differing token (default %(default)s)")
    p.add_argument("--dtype", choices=sorted(TOLERANCE),
                   help="the server's model dtype (default: from its /server_info, VLLM_SERVER_DEV_MODE=1)")
    p.add_argument("--tolerance", type=float, help="logprob tolerance (default: the dtype's rounding, "
                   + ", ".join(f"{k} {v:g}" for k, v in TOLERANCE.items()) + ")")
    p.add_argument("--no-warm", action="store_true", help="the prompts were already served: no warm-up")
    p.add_argument("--reset-prefix-cache", action="store_true",
                   help="empty vLLM's own prefix cache before each cached request, so that the connector "
                        "serves it (POST /reset_prefix_cache: the server needs VLLM_SERVER_DEV_MODE=1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")


def main(args: argparse.Namespace) -> int:
    try:
        report = verify(args)
    except (ServerError, PromptError, ValueError) as e:
        print(f"lmcache verify: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else render(report))
    named = [r["name"] for r in report["prompts"] if r["verdict"] == MISMATCH]
    if named:
        print(f"lmcache verify: MISMATCH beyond {report['dtype'] or 'the given'} rounding (tolerance "
              f"{report['tolerance']:g}): {', '.join(named)}", file=sys.stderr)
    return report["exit_status"]


def verify(args: argparse.Namespace) -> dict[str, Any]:
    if args.max_tokens < 1 or args.top_logprobs < 1:
        raise ValueError("--max-tokens and --top-logprobs must be >= 1")
    if args.tolerance is not None and not args.tolerance >= 0:
        raise ValueError(f"--tolerance must be >= 0, got {args.tolerance}")
    client = OpenAIClient(args.url, timeout=args.timeout)
    model = args.model or client.model()
    dtype = args.dtype or client.dtype()
    if args.tolerance is not None:
        tolerance, why = args.tolerance, "--tolerance"
    elif dtype in TOLERANCE:
        tolerance, why = TOLERANCE[dtype], f"{dtype} rounding"
    else:
        raise ValueError(f"the server does not say its dtype ({dtype or 'no /server_info'}): give --dtype "
                         "or --tolerance")
    if args.prompts:
        prompts = load_prompts(args.prompts)
    else:
        prompts = generate_prompts(client, model, args.corpus, _lengths(args.lengths))
    if not args.no_warm:
        for prompt in prompts:
            client.complete(model, prompt.prompt, 1, 1)
    results = [_check(client, model, prompt, args, tolerance) for prompt in prompts]
    verdicts = {r.verdict for r in results}
    status = 1 if MISMATCH in verdicts else 2 if UNVERIFIED in verdicts else 0
    return {"url": client.base_url, "model": model, "dtype": dtype, "tolerance": tolerance,
            "tolerance_from": why, "max_tokens": args.max_tokens,
            "hit_tokens_from": HIT_SOURCE if results[0].hit_tokens is not None else None,
            "prefix_cache_reset": args.reset_prefix_cache, "warmed_up": not args.no_warm,
            "prompts": [asdict(r) for r in results], "exit_status": status}


def _lengths(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--lengths must be comma-separated token counts, got {text!r}") from None


def _check(client: OpenAIClient, model: str, prompt: Prompt, args: argparse.Namespace,
           tolerance: float) -> PromptResult:
    if args.reset_prefix_cache:
        client.reset_prefix_cache()
    cached = client.complete(model, prompt.prompt, args.max_tokens, args.top_logprobs)
    fresh = client.complete(model, prompt.prompt, args.max_tokens, args.top_logprobs,
                            cache_salt=secrets.token_urlsafe(24))
    j = judge(cached, fresh, tolerance)
    verdict, note = j.verdict, j.note
    if fresh.cached_tokens:
        verdict = UNVERIFIED
        note = (f"the salted request was served {fresh.cached_tokens} tokens from a cache (a connector "
                f"that ignores cache_salt?): no fresh reference; {note or j.verdict}")
    diff = None if math.isinf(j.max_logprob_diff) else j.max_logprob_diff
    return PromptResult(prompt.name, prompt.preview, cached.prompt_tokens, cached.cached_tokens,
                        fresh.cached_tokens, j.tokens_equal, diff, j.first_difference, verdict, note)


def render(report: dict[str, Any]) -> str:
    rows = [("prompt", "tokens", "hit", "ref hit", "equal", "max |dlogprob|", "verdict")]
    for r in report["prompts"]:
        rows.append((r["name"], str(r["prompt_tokens"]), _count(r["hit_tokens"]),
                     _count(r["reference_hit_tokens"]), "yes" if r["tokens_equal"] else "no",
                     _diff(r["max_logprob_diff"]), r["verdict"]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"lmcache verify: {report['url']} model {report['model']}, {report['max_tokens']} greedy "
             f"tokens per prompt, cached request vs one with a fresh cache_salt",
             f"tolerance {report['tolerance']:g} ({report['tolerance_from']}); a token that differs "
             "after a near tie within it is a 'tie', not a mismatch"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines += [f"  {r['name']}: {r['note']}" for r in report["prompts"] if r["note"]]
    if report["hit_tokens_from"] is None:
        lines.append("hit tokens unknown: start the server with --enable-prompt-tokens-details")
    elif not any(r["hit_tokens"] for r in report["prompts"]):
        lines.append("no prompt was served from a cache: nothing cached was checked")
    if not report["prefix_cache_reset"]:
        lines.append("hits may come from vLLM's own prefix cache (--reset-prefix-cache checks the connector)")
    verdict = {0: "all prompts equal", 1: "MISMATCH", 2: "unverified"}[report["exit_status"]]
    lines.append(f"result: {verdict}")
    return "\n".join(lines)


def _diff(x: float | None) -> str:
    return "beyond top-k" if x is None else f"{x:.3g}"


def _count(n: int | None) -> str:
    return "unknown" if n is None else str(n)

