"""`lmcache verify` end to end against a small fake of vLLM's OpenAI server (one token per character):
its exit status, report and errors. The real servers are in tests/integration/vllm/test_verify.py."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest

from lmcache.cli import main
from lmcache.json_http import JsonHTTPService, RawReply
from tests.helpers.servers import free_port


class FakeServer:
    """Answers greedily from the prompt's tokens. A request without a salt whose prompt was asked
    before is "served from the cache": ``cached_tokens`` is all but one token, and its logprobs are
    shifted by `fault`. `ignore_salt`: salted requests are served from the cache too. `mangle`: turns
    every completion answer into another JSON value, as a broken server would."""

    def __init__(self, fault: float = 0.0, ignore_salt: bool = False, dtype: str = "float32",
                 dev_mode: bool = True, mangle: Callable[[dict[str, Any]], Any] | None = None) -> None:
        """`dev_mode`: serve vLLM's dev-mode endpoints (/server_info with `dtype`, /reset_prefix_cache)."""
        self.fault, self.ignore_salt, self.mangle = fault, ignore_salt, mangle
        self.seen: set[tuple[int, ...]] = set()
        self.resets = 0
        routes: dict[tuple[str, str], Any] = {
            ("GET", "/v1/models"): lambda _: {"data": [{"id": "fake", "max_model_len": 4096}]},
            ("POST", "/tokenize"): lambda b: {"tokens": [ord(c) for c in b["prompt"]]},
            ("POST", "/detokenize"): lambda b: {"prompt": "".join(map(chr, b["tokens"]))},
            ("POST", "/v1/completions"): self._complete,
        }
        if dev_mode:
            routes[("POST", "/reset_prefix_cache")] = self._reset
            info = {"vllm_config": f"model='fake', dtype=torch.{dtype}, max_seq_len=4096"}
            routes[("GET", "/server_info")] = lambda _: info
        self.http = JsonHTTPService(routes, "127.0.0.1", 0, "fake-openai")
        self.url = f"http://127.0.0.1:{self.http.port}"

    def _reset(self, _: dict[str, Any]) -> dict[str, Any]:
        self.resets += 1
        return {"success": True}

    def _complete(self, body: dict[str, Any]) -> dict[str, Any] | RawReply:
        answer = self._answer(body)
        if self.mangle is None:
            return answer
        return RawReply("application/json", json.dumps(self.mangle(answer)).encode())

    def _answer(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body["prompt"]
        tokens = tuple(prompt if isinstance(prompt, list) else (ord(c) for c in prompt))
        hit = tokens in self.seen and (self.ignore_salt or "cache_salt" not in body)
        self.seen.add(tokens)
        shift = self.fault if hit else 0.0
        chosen = [(sum(tokens) + i) % 1000 for i in range(body["max_tokens"])]
        return {"choices": [{"logprobs": {
            "tokens": [f"token_id:{t}" for t in chosen],
            "token_logprobs": [-0.5 + shift for _ in chosen],
            "top_logprobs": [{f"token_id:{t}": -0.5 + shift, f"token_id:{t + 1}": -1.5} for t in chosen]}}],
            "usage": {"prompt_tokens": len(tokens),
                      "prompt_tokens_details": {"cached_tokens": len(tokens) - 1 if hit else 0}}}

    def close(self) -> None:
        self.http.close()


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("The old sailor remembered the northern road.\n\nA quiet librarian counted coins.\n")
    return str(path)


def run(capsys, *args: str) -> tuple[int, str, str]:
    status = main(["verify", *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_equal_answers_exit_0_with_a_table_naming_the_tolerance_and_hits(capsys, prompts_file):
    server = FakeServer()
    try:
        status, out, _ = run(capsys, "--url", server.url, "--prompts", prompts_file, "--reset-prefix-cache")
    finally:
        server.close()
    assert status == 0
    assert "tolerance 0.0001 (float32 rounding)" in out and "result: all prompts equal" in out
    assert server.resets == 2  # before each prompt's cached request
    rows = [line.split() for line in out.splitlines() if line.startswith("line ")]
    assert [(r[1], r[-1]) for r in rows] == [("1", "equal"), ("3", "equal")]


def test_a_cached_answer_beyond_rounding_exits_1_naming_the_prompts(capsys, prompts_file):
    server = FakeServer(fault=0.3)
    try:
        status, out, err = run(capsys, "--url", server.url, "--prompts", prompts_file, "--json")
    finally:
        server.close()
    report = json.loads(out)
    assert status == 1 == report["exit_status"]
    assert [r["verdict"] for r in report["prompts"]] == ["MISMATCH", "MISMATCH"]
    assert [r["hit_tokens"] for r in report["prompts"]] == [43, 31]
    assert all(abs(r["max_logprob_diff"] - 0.3) < 1e-9 for r in report["prompts"])
    assert "MISMATCH" in err and "line 1, line 3" in err


def test_a_fault_within_the_given_tolerance_passes(capsys, prompts_file):
    server = FakeServer(fault=0.1, dev_mode=False)
    try:
        status, _, _ = run(capsys, "--url", server.url, "--prompts", prompts_file, "--dtype", "bfloat16")
    finally:
        server.close()
    assert status == 0


def test_a_salted_request_served_from_a_cache_leaves_the_prompt_unverified(capsys, prompts_file):
    server = FakeServer(ignore_salt=True)
    try:
        status, out, _ = run(capsys, "--url", server.url, "--prompts", prompts_file)
    finally:
        server.close()
    assert status == 2
    assert "unverified" in out and "ignores cache_salt" in out


def test_generated_prompts_have_the_asked_lengths_and_do_not_share_a_prefix(capsys, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(chr(65 + i % 26) for i in range(500)))
    server = FakeServer()
    try:
        status, out, _ = run(capsys, "--url", server.url, "--corpus", str(corpus), "--lengths", "100,120,50",
                             "--json")
        too_long = run(capsys, "--url", server.url, "--corpus", str(corpus), "--lengths", "900")
    finally:
        server.close()
    report = json.loads(out)
    assert status == 0
    assert [r["prompt_tokens"] for r in report["prompts"]] == [100, 120, 50]
    assert [r["name"] for r in report["prompts"]] == ["100 tokens @0", "120 tokens @166", "50 tokens @333"]
    assert too_long[0] == 2 and "has 500 tokens; the longest prompt asks 900" in too_long[2]


def test_an_unreachable_server_exits_2_saying_so(capsys, prompts_file):
    status, _, err = run(capsys, "--url", f"127.0.0.1:{free_port()}", "--prompts", prompts_file,
                         "--timeout", "5")
    assert status == 2 and "cannot reach" in err


@pytest.mark.parametrize(("name", "content", "message"), [
    ("empty.txt", "\n\n", "holds no prompt"),
    ("bad.jsonl", '{"prompt": "ok"}\n{"prompt": \n', "bad.jsonl line 2: not JSON"),
    ("neither.jsonl", '{"text": "x"}\n', 'line 1: must be an object with "prompt"'),
    ("ids.jsonl", '{"tokens": [1, -2]}\n', '"tokens" must be a non-empty list of token ids'),
])
def test_a_bad_prompts_file_exits_2_naming_the_line(capsys, tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    server = FakeServer()
    try:
        status, _, err = run(capsys, "--url", server.url, "--prompts", str(path))
    finally:
        server.close()
    assert status == 2 and message in err


def test_a_missing_prompts_file_an_unknown_dtype_and_no_dev_mode_exit_2(capsys, tmp_path, prompts_file):
    server = FakeServer(dev_mode=False)
    try:
        missing = run(capsys, "--url", server.url, "--prompts", str(tmp_path / "nope.txt"),
                      "--dtype", "float32")
        no_dtype = run(capsys, "--url", server.url, "--prompts", prompts_file)
        no_reset = run(capsys, "--url", server.url, "--prompts", prompts_file, "--dtype", "float32",
                       "--reset-prefix-cache")
        bad_tolerance = run(capsys, "--url", server.url, "--prompts", prompts_file, "--tolerance", "-1")
    finally:
        server.close()
    assert missing[0] == 2 and "cannot read the prompts file" in missing[2]
    assert no_dtype[0] == 2 and "give --dtype or --tolerance" in no_dtype[2]
    assert no_reset[0] == 2 and "HTTP 404" in no_reset[2] and "VLLM_SERVER_DEV_MODE=1" in no_reset[2]
    assert bad_tolerance[0] == 2 and "--tolerance must be >= 0" in bad_tolerance[2]


def test_nan_logprobs_in_the_cached_answer_are_a_mismatch(capsys, prompts_file):
    server = FakeServer(fault=math.nan)  # the cached answers' logprobs are NaN (e.g. corrupt KV)
    try:
        status, out, _ = run(capsys, "--url", server.url, "--prompts", prompts_file, "--json")
    finally:
        server.close()
    assert status == 1
    assert [r["verdict"] for r in json.loads(out)["prompts"]] == ["MISMATCH", "MISMATCH"]


def _logprobs(answer: dict[str, Any]) -> dict[str, Any]:
    return answer["choices"][0]["logprobs"]


def _edit(change: Callable[[dict[str, Any]], object]) -> Callable[[dict[str, Any]], Any]:
    """A mangle that changes the answer in place."""
    def mangle(answer: dict[str, Any]) -> Any:
        change(answer)
        return answer
    return mangle


MALFORMED: dict[str, Callable[[dict[str, Any]], Any]] = {
    "null top_logprobs": _edit(lambda a: _logprobs(a)["top_logprobs"].__setitem__(0, None)),
    "null usage": _edit(lambda a: a.__setitem__("usage", None)),
    "details not an object": _edit(lambda a: a["usage"].__setitem__("prompt_tokens_details", [3])),
    "cached_tokens not a count": _edit(
        lambda a: a["usage"].update(prompt_tokens_details={"cached_tokens": "7"})),
    "token not a string": _edit(lambda a: _logprobs(a)["tokens"].__setitem__(0, 17)),
    "fewer logprobs than tokens": _edit(lambda a: _logprobs(a)["token_logprobs"].pop()),  # a partial answer
    "fewer top_logprobs than tokens": _edit(lambda a: _logprobs(a)["top_logprobs"].pop()),
    "no tokens": _edit(lambda a: _logprobs(a).update(tokens=[], token_logprobs=[], top_logprobs=[])),
    "not an object": lambda a: [a],
}


@pytest.mark.parametrize("mangle", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_completion_answer_exits_2_saying_so(capsys, prompts_file, mangle):
    server = FakeServer(mangle=mangle)
    try:
        status, out, err = run(capsys, "--url", server.url, "--prompts", prompts_file)
    finally:
        server.close()
    assert status == 2 and "/v1/completions: unexpected answer" in err
    assert "Traceback" not in err and "all prompts equal" not in out


@pytest.mark.parametrize(("route", "answer"), [
    (("GET", "/v1/models"), {"data": [{"name": "fake"}]}),
    (("GET", "/v1/models"), ["fake"]),
    (("POST", "/tokenize"), {"ids": [1, 2]}),
    (("POST", "/tokenize"), {"tokens": ["a", "b"]}),
    (("POST", "/detokenize"), {"text": "abc"}),
])
def test_a_malformed_answer_of_another_endpoint_exits_2_naming_it(capsys, tmp_path, route, answer):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text to cut prompts from " * 20)
    server = FakeServer()
    server.http._routes[route] = lambda _: RawReply("application/json", json.dumps(answer).encode())
    try:
        status, _, err = run(capsys, "--url", server.url, "--corpus", str(corpus), "--lengths", "50")
    finally:
        server.close()
    assert status == 2 and f"{route[1]}: unexpected answer" in err
