"""A fake vLLM OpenAI server for tests: real aiohttp on loopback, vLLM 0.32 response
format (shared/notes/vllm-0.32-openai-api.md), scripted model output.

vLLM is outside the project, so tests may fake it; everything of Libra's stays real.
The "model" reads the decoded prompt and follows a script (see `respond`): by default it
solves `arith` tasks with one calculator call; a `DIRECTIVE:<name>` in the prompt selects
misbehaviour (malformed calls, unknown tools, rambling, loops).

Run as a process:  python tests/fakes/vllm_fake.py --model DIR --port P [--delay S]
"""

from __future__ import annotations

import argparse
import asyncio
import re
from typing import Any

import orjson
from aiohttp import web
from tokenizers import Tokenizer

MODEL_NAME = "fake-model"
_Q = re.compile(r"What is (.+?)\?")
_RESP = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)
_DIRECTIVE = re.compile(r"DIRECTIVE:([\w-]+)")
_USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.DOTALL)
_TITLE = re.compile(r"Title: ([^)]*)\)")


def search_turn(prompt: str, responses: list[str]) -> str:
    """`DIRECTIVE:search`: search for the question, then answer with the first hit's title
    (results in Search-R1's `Doc 1(Title: ...) text` format)."""
    if responses:
        hit = _TITLE.search(responses[-1])
        return f"Found it. <answer>{hit.group(1) if hit else 'unknown'}</answer>"
    asked = [u for u in _USER.findall(prompt) if "DIRECTIVE:search" in u]
    query = (asked[-1] if asked else "").replace("DIRECTIVE:search", "").strip()
    args = orjson.dumps({"query": query}).decode()
    return f'<tool_call>{{"name": "search", "arguments": {args}}}</tool_call>'


HOSTILE = {
    "oom": ("head -c 400000000 /dev/zero | tail -c 300000000 > /dev/null; echo exit=$?", 120),
    "fork": ("(bomb() { bomb | bomb & }; bomb) 2>&1 | head -c 300; sleep 5", 10),
    "loop": ("while :; do :; done", 2),
    "flood": ("head -c 1000000000 /dev/zero | tr '\\0' x", 60),
}
"""`DIRECTIVE:hostile-<kind>`: one `bash` call running hostile code, then an answer."""


def respond(prompt: str) -> tuple[str, bool]:
    """(text, ends_with_eos) the scripted model generates for a decoded prompt."""
    directive = m.group(1) if (m := _DIRECTIVE.search(prompt)) else "arith"
    responses = _RESP.findall(prompt)
    question = _Q.findall(prompt)
    expr = question[-1] if question else "1 + 1"
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
    if directive == "ramble":
        return "la " * 10_000, False
    if directive == "loop":
        return call % expr, True
    if directive == "search":
        return search_turn(prompt, responses), True
    if directive.startswith("hostile-") and not responses:
        cmd, timeout = HOSTILE[directive.removeprefix("hostile-")]
        args = orjson.dumps({"command": cmd, "timeout": timeout}).decode()
        return f'<tool_call>{{"name": "bash", "arguments": {args}}}</tool_call>', True
    if directive in ("fetch-short", "fetch-long"):
        # Causal episodes for routing tests: a short one fetches once; a long one fetches
        # three times, each fetch returning a big page.
        kind, wanted = ("short", 1) if directive == "fetch-short" else ("long", 3)
        if len(responses) < wanted:
            return (
                f'<tool_call>{{"name": "fetch", "arguments": {{"kind": "{kind}"}}}}</tool_call>',
                True,
            )
        return "<answer>done</answer>", True
    if responses:
        value = responses[-1].strip()[:16]
        return f"The tool says {value}. <answer>{value}</answer>", True
    if directive == "bad-json":
        return "<tool_call>{not json]</tool_call>", True
    if directive == "unterminated":
        return '<tool_call>{"name": "calculator"', True
    if directive == "unknown-tool":
        return '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', True
    if directive == "two-calls":
        return (call % expr) + "\n" + (call % "2 * 3"), True
    if directive == "bad-args":
        return '<tool_call>{"name": "calculator", "arguments": {"expr": 1}}</tool_call>', True
    if directive == "direct":
        return "<answer>42</answer>", True
    if directive == "qwen-xml":  # Qwen3-Coder's call format (tool_parser = "qwen3_coder")
        xml = "<tool_call>\n<function=calculator>\n<parameter=expression>\n%s\n</parameter>"
        return (xml % expr) + "\n</function>\n</tool_call>", True
    return f"Let me compute.\n{call % expr}", True


class FakeVLLM:
    def __init__(self, model_dir: str, delay: float = 0.0):
        self.tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
        self.eos = self.tok.token_to_id("<|im_end|>")
        self.delay = delay
        self.honor_stop = False
        """Honour `stop` strings (off by default: tests written before it expect them
        ignored)."""
        self.requests: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/_log", self.log)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]}
        )

    async def log(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(self.requests), content_type="application/json")

    async def completions(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        if body.get("model") != MODEL_NAME:
            return web.json_response(
                {
                    "error": {
                        "message": f"The model `{body.get('model')}` does not exist.",
                        "code": 404,
                    }
                },
                status=404,
            )
        prompt_ids = body["prompt"]
        text, eos = respond(self.tok.decode(prompt_ids, skip_special_tokens=False))
        ids = self.tok.encode(text, add_special_tokens=False).ids + ([self.eos] if eos else [])
        finish, stop_reason = "stop", None
        stops = set(body.get("stop_token_ids") or [])
        for i, t in enumerate(ids):
            if t in stops and t != self.eos:
                ids, stop_reason = ids[: i + 1], t
                break
        for i in range(len(ids) if self.honor_stop else 0):
            # stop strings (opt-in): cut after the token that completes one, as vLLM does
            # with include_stop_str_in_output
            text = self.tok.decode(ids[: i + 1])
            hit = next((s for s in body.get("stop") or () if s in text), None)
            if hit is not None:
                ids, stop_reason = ids[: i + 1], hit
                break
        if len(ids) > body["max_tokens"]:
            ids, finish, stop_reason = ids[: body["max_tokens"]], "length", None
        if self.delay:
            await asyncio.sleep(self.delay)
        logprobs = [-((t * 7919) % 997) / 1000.0 for t in ids]
        self.requests.append(
            {"prompt": prompt_ids, "token_ids": ids, "max_tokens": body["max_tokens"]}
        )
        choice = {
            "index": 0,
            "text": self.tok.decode(ids),
            "logprobs": {
                "text_offset": [0] * len(ids),
                "token_logprobs": logprobs,
                "tokens": [self.tok.id_to_token(t) for t in ids],
                "top_logprobs": [
                    {self.tok.id_to_token(t): lp} for t, lp in zip(ids, logprobs, strict=True)
                ],
            },
            "finish_reason": finish,
            "stop_reason": stop_reason,
            "token_ids": ids,
            "prompt_logprobs": None,
            "prompt_token_ids": prompt_ids,
        }
        return web.json_response(
            {
                "id": "cmpl-fake",
                "object": "text_completion",
                "created": 0,
                "model": MODEL_NAME,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": len(prompt_ids),
                    "completion_tokens": len(ids),
                    "total_tokens": len(prompt_ids) + len(ids),
                },
            },
            dumps=lambda o: orjson.dumps(o).decode(),
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--delay", type=float, default=0.0)
    args = ap.parse_args()
    web.run_app(
        FakeVLLM(args.model, args.delay).app(), host="127.0.0.1", port=args.port, print=None
    )


if __name__ == "__main__":
    main()
