"""`libra serve-engine` as a user runs it: the default model on first use, bad flags as
one line, and the Hermes tool-call parsing of chat responses (vLLM's rules)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from libra.engine.responses import parse_tool_calls
from tests.conftest import ROOT, free_port, wait_http


def test_serves_the_default_model_made_on_first_use(tmp_path: Path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "libra", "serve-engine", "--port", str(port)],
        cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=120)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models") as r:
            [model] = json.loads(r.read())["data"]
        folder = Path(model["id"])
        assert folder.parent == tmp_path / "libra" / "models"
        assert (folder / "model.safetensors").is_file()
        body = json.dumps({"prompt": "Hello", "max_tokens": 3}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body, {"content-type": "application/json"}
        )
        with urllib.request.urlopen(req) as r:
            out = json.loads(r.read())
        assert out["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "/no/such/folder"], "/no/such/folder"),
        (["--port", "70000"], "--port"),
        (["--threads", "0"], "--threads"),
    ],
)
def test_bad_flags_are_one_line(args, needle, tiny_model):
    done = subprocess.run(
        [sys.executable, "-m", "libra", "serve-engine", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and needle in done.stderr
    assert "Traceback" not in done.stderr


def test_port_in_use_is_one_line(tiny_model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "libra", "serve-engine", "--model", str(tiny_model),
             "--port", str(port)],
            cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    assert done.returncode == 2
    assert f"127.0.0.1:{port}" in done.stderr and "Traceback" not in done.stderr


def test_hermes_tool_calls_parsed_like_vllm():
    content, calls = parse_tool_calls(
        'Let me look.<tool_call>\n{"name": "search", "arguments": {"q": "日本"}}\n</tool_call>'
        '<tool_call>{"name": "calc", "arguments": {"x": 1}}'  # unterminated: still a call
    )
    assert content == "Let me look."
    assert [(c["type"], c["function"]["name"]) for c in calls] == [
        ("function", "search"),
        ("function", "calc"),
    ]
    assert calls[0]["function"]["arguments"] == '{"q": "日本"}'  # ensure_ascii=False
    assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["id"] != calls[1]["id"]
    # Content empty before the first call -> None; no calls -> the text as it is.
    assert parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call>')[0] is None
    assert parse_tool_calls("plain answer") == ("plain answer", [])
    # One malformed call: nothing is parsed and the whole text stays content.
    bad = 'x<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{oops</tool_call>'
    assert parse_tool_calls(bad) == (bad, [])


def test_a_broken_config_json_is_one_line(tmp_path: Path, tiny_model: Path) -> None:
    """Invalid JSON was a JSONDecodeError traceback, a missing key a KeyError; with
    `num_hidden_layers` 0 the engine served a model without its layers."""
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    good = json.loads((model / "config.json").read_text())
    for text, needle in (
        ("{not json", "not valid JSON"),
        (json.dumps({**good, "num_hidden_layers": 0}), "num_hidden_layers is 0"),
        (json.dumps({k: v for k, v in good.items() if k != "max_position_embeddings"}),
         "max_position_embeddings is None"),
    ):  # fmt: skip
        (model / "config.json").write_text(text)
        done = subprocess.run(
            [sys.executable, "-m", "libra", "serve-engine", "--model", str(model)],
            cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and needle in done.stderr, done.stderr


async def test_a_large_prompt_is_tokenized_off_the_event_loop(tiny_model: Path) -> None:
    """A 1 MB prompt held every request of the engine (`/health` included) for 1-1.5 s
    while it was rendered and tokenized on the event loop. Here the tokenizer waits until
    `/health` has been answered meanwhile: on the loop it would wait for ever."""
    import asyncio
    import threading

    import aiohttp
    from aiohttp.test_utils import TestServer

    from libra.engine.server import EmbeddedEngine, build_app

    engine = EmbeddedEngine(tiny_model)
    engine.core.start()
    encoding, answered = threading.Event(), threading.Event()
    encode = engine.encode

    def waiting_encode(text: str) -> list[int]:
        if len(text) > 100_000:
            encoding.set()
            if not answered.wait(timeout=20):
                raise AssertionError("/health was not answered while a prompt was tokenized")
        return encode(text)

    engine.encode = waiting_encode  # type: ignore[method-assign]
    server = TestServer(build_app(engine))
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as s:
            big = "word " * 250_000  # 1.25 MB: longer than the context, refused after
            for route, body in (
                ("/v1/completions", {"prompt": big, "max_tokens": 1}),
                ("/v1/chat/completions",
                 {"messages": [{"role": "user", "content": big}], "max_tokens": 1}),
            ):  # fmt: skip
                encoding.clear()
                answered.clear()
                post = asyncio.create_task(s.post(server.make_url(route), json=body))
                assert await asyncio.to_thread(encoding.wait, 20)
                async with s.get(server.make_url("/health")) as r:
                    assert r.status == 200
                answered.set()
                async with await post as r:
                    assert r.status == 400 and "maximum context length" in await r.text()
    finally:
        await server.close()
        await asyncio.to_thread(engine.core.stop)
