"""`libra serve-engine`: the embedded OpenAI-compatible inference server (aiohttp).

Routes (bodies as vLLM 0.32 writes them): `GET /health`, `GET /v1/models`,
`POST /v1/completions`, `POST /v1/chat/completions`, and `POST /v1/load_weights
{"path": DIR}` (Libra's own: swap in a checkpoint of the same architecture; requests
already running finish on the old weights, later ones run on the new — see
`libra.engine.core`), and vLLM's weight-transfer routes (`/init_weight_transfer_engine`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update`: weights broadcast
by the trainer, `libra.engine.receive`). Like vLLM's, the weight routes are for the
trainer that owns the engine: serve it on loopback or a private network. The model
runs on the engine's worker thread, never on the event loop. A client that disconnects
aborts its request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from libra.auth import is_loopback, page_refusal
from libra.chat import ChatTokenizer
from libra.engine import protocol, responses
from libra.engine.core import Choice, EngineCore, Request
from libra.engine.model import Decoder, ModelConfig, load_weights
from libra.engine.receive import Receiver
from libra.errors import LibraError, ModelError

log = logging.getLogger(__name__)


class EmbeddedEngine:
    """The loaded model folder, its tokenizer and the running `EngineCore`."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        served_model_name: str | None = None,
        max_num_seqs: int = 64,
        kv_cache_gib: float = 2.0,
        threads: int = 1,
        seed: int | None = None,
        dtype: str = "auto",
    ):
        self.model_dir = Path(model_dir)
        self.dtype = dtype
        self.cfg = ModelConfig.load(self.model_dir, dtype)
        self.chat = ChatTokenizer(self.model_dir)
        self.tokenizer = self.chat.tokenizer
        self.name = served_model_name or str(model_dir)
        self.limits = protocol.Limits(
            self.name, self.cfg.max_position_embeddings, self.cfg.vocab_size, max_num_seqs
        )
        decoder = Decoder(self.cfg, load_weights(self.model_dir, self.cfg))
        self.core = EngineCore(
            decoder,
            self.tokenizer,
            frozenset(self.chat.eos_token_ids),
            max_num_seqs=max_num_seqs,
            kv_cache_bytes=int(kv_cache_gib * (1 << 30)),
            threads=threads,
            seed=seed,
        )
        self.weights_path = self.model_dir
        self._load_lock = asyncio.Lock()
        self.receiver = Receiver(self.cfg)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    async def generate(self, prompt: list[int], params: list[Any]) -> list[Choice]:
        """Run one prompt's choices; cancelling this coroutine aborts them."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[Choice]] = loop.create_future()

        def done(result: list[Choice] | BaseException) -> None:
            loop.call_soon_threadsafe(_settle, fut, result)

        req = Request(id=f"{id(fut):x}", prompt=prompt, params=params, on_done=done)
        self.core.submit(req)
        try:
            return await fut
        except asyncio.CancelledError:
            self.core.abort(req)
            raise

    async def swap(self, path: Path) -> dict[str, Any]:
        """Load `path` (same architecture and sizes) and swap it in (see module doc)."""
        new_cfg = await asyncio.to_thread(ModelConfig.load, path, self.dtype)
        if new_cfg != self.cfg:
            raise ModelError(
                f"{path}: config differs from the served model's ({self.model_dir}); "
                "load_weights needs a checkpoint of the same architecture and sizes"
            )
        async with self._load_lock:
            t0 = time.perf_counter()
            weights = await asyncio.to_thread(load_weights, path, new_cfg)
            t1 = time.perf_counter()
            await self._swap_in(weights)
            self.weights_path = path
            return {
                "status": "ok",
                "path": str(path),
                "load_s": t1 - t0,
                "swap_s": time.perf_counter() - t1,
            }

    async def finish_broadcast(self) -> dict[str, Any]:
        """Swap in the weights a broadcast delivered (`libra.engine.receive`)."""
        async with self._load_lock:
            weights = await self.receiver.finish()  # of the served model's shapes (`fuse`)
            t0 = time.perf_counter()
            await self._swap_in(weights)
            self.weights_path = Path("<broadcast>")
            return {"status": "ok", "swap_s": time.perf_counter() - t0}

    async def _swap_in(self, weights: dict[str, Any]) -> None:
        """Hand `weights` to the engine thread; returns once no step uses the old ones."""
        loop = asyncio.get_running_loop()
        swapped: asyncio.Future[None] = loop.create_future()

        def done() -> None:
            loop.call_soon_threadsafe(_settle, swapped, None)

        self.core.swap_weights(weights, done)
        await swapped


def _object(body: dict[str, Any], key: str) -> dict[str, Any]:
    value = body.get(key)
    if not isinstance(value, dict):
        raise protocol.bad(f"{key} must be a JSON object", key)
    return value


def _settle(fut: asyncio.Future, result: Any) -> None:
    if fut.done():
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(body), status=status, content_type="application/json")


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except protocol.ApiError as e:
        return _json(e.body(), e.status)
    except LibraError as e:
        return _json(protocol.bad(str(e)).body(), 400)
    except web.HTTPException:
        raise
    except Exception as e:  # the server keeps serving; the client gets a 500 body
        log.exception("request failed")
        return _json(protocol.ApiError(500, f"internal error: {e}").body(), 500)


T = TypeVar("T")
OFFLOAD_BYTES = 64 << 10
"""A request body past this is parsed, rendered and tokenized in a worker thread: on
the event loop a 1 MB prompt held every request of the engine (`/health` included) for
1-1.5 s; below it a thread costs more than the work."""


async def _off(raw: bytes, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`: in a worker thread when the body `raw` is large, else here."""
    if len(raw) > OFFLOAD_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        raise protocol.bad("messages must be a non-empty list of message objects", "messages")
    out = []
    for original in msgs:
        m = dict(original)
        if isinstance(m.get("content"), list):  # OpenAI content parts -> text, as vLLM does
            m["content"] = "".join(p.get("text", "") for p in m["content"] if isinstance(p, dict))
        calls = []
        for call in m.get("tool_calls") or []:
            fn = dict(call.get("function") or {})
            if isinstance(fn.get("arguments"), str):  # vLLM parses argument strings first
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    raise protocol.bad(
                        "tool_calls[].function.arguments is not valid JSON"
                    ) from None
            calls.append({**call, "function": fn})
        if calls:
            m["tool_calls"] = calls
        out.append(m)
    return out


def _pages(loopback: bool) -> Any:
    """Refuse what a web page may send (`libra.auth.page_refusal`): the engine has no
    token, and `/v1/load_weights` swaps the served weights for any folder it can read.
    `loopback`: it is bound to a loopback address, so a request for another host name
    is a page that rebound its name."""

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        refused = page_refusal(request.headers.get("Origin"), request.headers.get("Host"),
                               loopback_only=loopback)  # fmt: skip
        if refused is not None:
            return _json(protocol.ApiError(403, refused).body(), 403)
        return await handler(request)

    return check


def build_app(engine: EmbeddedEngine, host: str = "127.0.0.1") -> web.Application:
    """`host`: the address it will be bound to."""
    app = web.Application(
        middlewares=[_errors, _pages(is_loopback(host))], client_max_size=64 << 20
    )

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(_: web.Request) -> web.Response:
        created = int(time.time())
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": engine.name,
                        "object": "model",
                        "created": created,
                        "owned_by": "libra",
                        "root": str(engine.model_dir),
                        "parent": None,
                        "max_model_len": engine.limits.context,
                        "permission": [],
                    }
                ],
            }
        )

    async def metrics(_: web.Request) -> web.Response:
        # The two gauges of vLLM's /metrics that load balancers and tests read.
        running, waiting = engine.core.load
        label = f'{{model_name="{engine.name}"}}'
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{label} {running}\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{label} {waiting}\n"
        )
        return web.Response(text=text, content_type="text/plain")

    async def completions(request: web.Request) -> web.Response:
        raw = await request.read()
        body = await _off(raw, protocol.parse_json, raw)
        protocol.check_model(body, engine.limits)
        batch = await _off(raw, protocol.prompts, body, engine.encode, engine.limits)
        params = [
            protocol.sampling(body, len(p), engine.limits, default_max=16, chat=False)
            for p in batch
        ]
        async with asyncio.TaskGroup() as tg:
            tasks = [
                tg.create_task(engine.generate(p, ps)) for p, ps in zip(batch, params, strict=True)
            ]
        outs = [(p, t.result()) for p, t in zip(batch, tasks, strict=True)]
        return _json(
            responses.completion(
                engine.name, engine.tokenizer, outs, bool(body.get("return_token_ids"))
            )
        )

    async def chat_completions(request: web.Request) -> web.Response:
        raw = await request.read()
        body = await _off(raw, protocol.parse_json, raw)
        protocol.check_model(body, engine.limits)
        messages = _messages(body)
        tools = body.get("tools") or None
        choice = body.get("tool_choice") or ("auto" if tools else "none")
        if choice not in ("auto", "none"):
            raise protocol.bad(
                f"tool_choice {choice!r} is not supported by the embedded engine "
                "(use 'auto' or 'none')",
                "tool_choice",
            )
        gen_prompt = bool(body.get("add_generation_prompt", True))

        def tokens() -> list[int]:
            text = engine.chat.render(messages, tools, add_generation_prompt=gen_prompt)
            ids = engine.encode(text)
            protocol.check_prompt(ids, engine.limits)
            return ids

        prompt = await _off(raw, tokens)
        params = protocol.sampling(body, len(prompt), engine.limits, default_max=None, chat=True)
        parse_tools = bool(tools) and choice == "auto"
        if parse_tools:  # as vLLM's Hermes parser: tool-call tags must reach the parser
            for p in params:
                p.skip_special_tokens = False
        outs = await engine.generate(prompt, params)
        return _json(
            responses.chat(
                engine.name,
                engine.tokenizer,
                prompt,
                outs,
                parse_tools=parse_tools,
                return_ids=bool(body.get("return_token_ids")),
            )
        )

    async def load(request: web.Request) -> web.Response:
        body = protocol.parse_json(await request.read())
        path = body.get("path")
        if not isinstance(path, str) or not path:
            raise protocol.bad(f"path must be a model folder, got {path!r}", "path")
        return _json(await engine.swap(Path(path)))

    async def transfer(request: web.Request) -> web.Response:
        """vLLM's weight-transfer routes (`libra.engine.receive`)."""
        phase = request.match_info["phase"]
        raw = await request.read()
        body = protocol.parse_json(raw) if raw else {}
        r = engine.receiver
        if phase == "init_weight_transfer_engine":
            await r.init(_object(body, "init_info"))
        elif phase == "start_weight_update":
            await r.start()
        elif phase == "update_weights":
            await r.update(_object(body, "update_info"))
        elif phase == "finish_weight_update":
            return _json(await engine.finish_broadcast())
        else:
            r.shutdown()
        return _json({"status": "ok"})

    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/load_weights", load)
    phases = "|".join(("init_weight_transfer_engine", "start_weight_update", "update_weights",
                       "finish_weight_update", "shutdown_weight_transfer_engine"))  # fmt: skip
    app.router.add_post(f"/{{phase:{phases}}}", transfer)
    return app


async def serve(engine: EmbeddedEngine, host: str, port: int, ready: Any = None) -> None:
    """Serve until cancelled; `ready(port)` is called once the socket listens."""
    engine.core.start()
    runner = web.AppRunner(build_app(engine, host), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        if ready is not None:
            ready(bound)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await asyncio.to_thread(engine.core.stop)


__all__ = ["EmbeddedEngine", "build_app", "serve"]
