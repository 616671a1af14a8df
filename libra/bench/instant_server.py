"""An OpenAI-compatible server that answers instantly, for `libra bench control-plane`.

It speaks vLLM's `/v1/completions` format with precomputed token ids: while the prompt
holds fewer than `--turns - 1` tool responses it returns a `noop` tool call, then an
`<answer>`. Runs in its own process so that its CPU does not count as Libra's.

    python -m libra.bench.instant_server --model DIR --port P [--turns 4]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from libra.chat import ChatTokenizer

MODEL = "instant"


def build_app(model_dir: str, turns: int) -> web.Application:
    tok = ChatTokenizer(model_dir)
    eos = tok.eos_token_ids[0]
    marker = tok.token_id("<tool_response>")
    if marker is None:
        raise SystemExit("the model's tokenizer has no single <tool_response> token")
    call = tok.encode('<tool_call>{"name": "noop", "arguments": {"x": 1}}</tool_call>') + [eos]
    answer = tok.encode("<answer>42</answer>")

    def body(ids: list[int], prompt: list[int]) -> bytes:
        lps = [-0.5] * len(ids)
        choice: dict[str, Any] = {
            "index": 0,
            "text": "",
            "logprobs": {
                "token_logprobs": lps,
                "tokens": [],
                "top_logprobs": [],
                "text_offset": [],
            },
            "finish_reason": "stop",
            "stop_reason": None,
            "token_ids": ids,
            "prompt_token_ids": None,
        }
        return orjson.dumps(
            {
                "id": "cmpl-instant",
                "object": "text_completion",
                "model": MODEL,
                "choices": [choice],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)},
            }
        )

    async def completions(request: web.Request) -> web.Response:
        req = orjson.loads(await request.read())
        prompt = req["prompt"]
        done = prompt.count(marker)
        ids = call if done < turns - 1 else answer
        return web.Response(body=body(ids, prompt), content_type="application/json")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--turns", type=int, default=4)
    args = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    web.run_app(
        build_app(args.model, args.turns),
        host="127.0.0.1",
        port=args.port,
        print=None,
        access_log=None,
        backlog=4096,
    )


@contextmanager
def running(
    model: str | Path | None, turns: int, pids: list[int] | None = None
) -> Iterator[tuple[str, Path]]:
    """Start this server in its own process; yield (its URL, the model folder). Without
    `model`, a fresh tiny model is made in a temporary folder. `pids` gets the server's
    process id (to read its CPU time)."""
    with tempfile.TemporaryDirectory(prefix="libra-instant-") as d:
        if model is None:
            from libra.engine.model_maker import make_model

            model = make_model(Path(d) / "model", seed=0)
        from libra.cluster.process import free_port

        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "libra.bench.instant_server", "--model", str(model),
             "--port", str(port), "--turns", str(turns)],
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        if pids is not None:
            pids.append(server.pid)
        try:
            _wait(url, server)
            yield url, Path(model)
        finally:
            server.terminate()
            server.wait(10)


def _wait(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"instant server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("instant server did not start in 60 s")


if __name__ == "__main__":
    main()
