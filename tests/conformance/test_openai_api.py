"""One API conformance suite, run against every engine (embedded, and real vLLM 0.32
TP=1 / TP=2 in the CI vLLM stage). What the rollout client and users rely on."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from tests.conformance.conftest import GREEDY_TOKENS, PROMPTS, Engine

COMPLETION_KEYS = {
    "id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
    "usage", "kv_transfer_params", "ec_transfer_params", "metrics",
}  # fmt: skip
CHOICE_KEYS = {
    "index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
    "prompt_logprobs", "prompt_token_ids", "routed_experts",
}  # fmt: skip
USAGE_KEYS = {
    "prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
    "completion_tokens_details",
}  # fmt: skip


async def post(engine: Engine, path: str, body: Any, raw: bytes | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s:
        data = raw if raw is not None else json.dumps(body).encode()
        headers = {"content-type": "application/json"}
        async with s.post(engine.url + path, data=data, headers=headers) as r:
            return r.status, await r.json(content_type=None)


def rollout_request(engine: Engine, prompt: list[int], **over: Any) -> dict[str, Any]:
    """Exactly what Libra's rollout client sends (token in, token out)."""
    body = {
        "model": engine.model, "prompt": prompt, "max_tokens": GREEDY_TOKENS,
        "temperature": 0.0, "top_p": 1.0, "logprobs": 1, "return_token_ids": True,
        "stop_token_ids": [], "stop": [], "skip_special_tokens": False,
        "include_stop_str_in_output": True, "ignore_eos": True,
    }  # fmt: skip
    return body | over


async def test_health_and_models(engine: Engine):
    async with aiohttp.ClientSession() as s:
        async with s.get(engine.url + "/health") as r:
            assert r.status == 200
        async with s.get(engine.url + "/v1/models") as r:
            models = await r.json()
    assert models["object"] == "list"
    [m] = models["data"]
    assert m["id"] == engine.model and m["object"] == "model"
    assert m["max_model_len"] == 4096


async def test_rollout_request_shape_and_greedy_matches_transformers(engine, reference):
    status, body = await post(engine, "/v1/completions", rollout_request(engine, PROMPTS[0]))
    assert status == 200, body
    assert set(body) == COMPLETION_KEYS and body["object"] == "text_completion"
    [c] = body["choices"]
    assert set(c) == CHOICE_KEYS and set(body["usage"]) == USAGE_KEYS
    assert c["token_ids"] == reference["s0"][0]
    assert c["prompt_token_ids"] == PROMPTS[0]
    assert c["finish_reason"] == "length" and c["stop_reason"] is None
    lp = c["logprobs"]
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert len(lp["token_logprobs"]) == len(c["token_ids"]) == GREEDY_TOKENS
    assert all(v <= 0.0 for v in lp["token_logprobs"])
    assert "".join(lp["tokens"]) == c["text"]
    assert lp["text_offset"][0] == 0
    assert body["usage"]["prompt_tokens"] == len(PROMPTS[0])
    assert body["usage"]["completion_tokens"] == GREEDY_TOKENS


async def test_logprobs_are_raw_not_temperature_scaled(engine, reference):
    greedy = (await post(engine, "/v1/completions", rollout_request(engine, PROMPTS[1])))[1]
    lp0 = greedy["choices"][0]["logprobs"]["token_logprobs"][0]
    first = reference["s0"][1][0]
    hot = rollout_request(engine, PROMPTS[1], max_tokens=1, temperature=0.6, seed=5, logprobs=5)
    body = (await post(engine, "/v1/completions", hot))[1]
    top = body["choices"][0]["logprobs"]["top_logprobs"][0]
    greedy_text = greedy["choices"][0]["logprobs"]["tokens"][0]
    assert top[greedy_text] == pytest.approx(lp0, abs=1e-3)
    assert greedy["choices"][0]["token_ids"][0] == first


async def test_stop_token_id_ends_with_that_token(engine, reference):
    ref = reference["s0"][0]
    stop_id = ref[3]
    cut = ref.index(stop_id)
    body = (
        await post(
            engine, "/v1/completions", rollout_request(engine, PROMPTS[0], stop_token_ids=[stop_id])
        )
    )[1]
    c = body["choices"][0]
    assert c["token_ids"] == ref[: cut + 1]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == stop_id
    assert len(c["logprobs"]["token_logprobs"]) == cut + 1
    excluded = rollout_request(
        engine, PROMPTS[0], stop_token_ids=[stop_id], include_stop_str_in_output=False
    )
    c2 = (await post(engine, "/v1/completions", excluded))[1]["choices"][0]
    assert c2["token_ids"] == c["token_ids"]
    assert c["text"] == c2["text"] + c["logprobs"]["tokens"][-1]


async def test_stop_string_cut_from_text_but_token_kept(engine):
    full = (await post(engine, "/v1/completions", rollout_request(engine, PROMPTS[1])))[1][
        "choices"
    ][0]
    tokens = full["logprobs"]["tokens"]
    stop = tokens[4].strip()[:2] or tokens[4]
    at = full["text"].find(stop)
    for include in (True, False):
        req = rollout_request(engine, PROMPTS[1], stop=[stop], include_stop_str_in_output=include)
        c = (await post(engine, "/v1/completions", req))[1]["choices"][0]
        assert c["finish_reason"] == "stop" and c["stop_reason"] == stop
        assert c["text"] == full["text"][: at + (len(stop) if include else 0)]
        n = len(c["token_ids"])
        assert c["token_ids"] == full["token_ids"][:n]
        assert stop in "".join(tokens[:n])[at:] and stop not in "".join(tokens[: n - 1])


async def test_text_prompts_batch_and_n_flatten_in_order(engine):
    body = {
        "model": engine.model, "prompt": ["Hello there", "The answer is"], "n": 2,
        "max_tokens": 3, "temperature": 1.0, "seed": 11, "return_token_ids": True,
    }  # fmt: skip
    status, out = await post(engine, "/v1/completions", body)
    assert status == 200, out
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    p0, p1 = out["choices"][0]["prompt_token_ids"], out["choices"][2]["prompt_token_ids"]
    assert (
        out["choices"][1]["prompt_token_ids"] == p0 and out["choices"][3]["prompt_token_ids"] == p1
    )
    assert out["usage"]["prompt_tokens"] == len(p0) + len(p1)
    assert out["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in out["choices"])
    again = (await post(engine, "/v1/completions", body))[1]
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in out["choices"]]


async def test_token_id_batch(engine, reference):
    body = rollout_request(engine, PROMPTS)
    status, out = await post(engine, "/v1/completions", body)
    assert status == 200, out
    assert [c["token_ids"] for c in out["choices"]] == reference["s0"]
    assert [c["prompt_token_ids"] for c in out["choices"]] == PROMPTS


@pytest.mark.parametrize(
    ("case", "body", "status", "needle"),
    [
        ("too long", {"prompt": [5] * 5000, "max_tokens": 2}, 400, "4096"),
        ("unknown model", {"model": "no-such-model", "prompt": "hi"}, 404, "no-such-model"),
        ("five stops", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ("zero max_tokens", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ("negative temperature", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("top_p zero", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
        ("out of vocabulary", {"prompt": [99999]}, 400, "99999"),
        ("greedy n=2", {"prompt": "hi", "n": 2, "temperature": 0}, 400, "n"),
    ],
)
async def test_bad_input_is_a_clear_error_and_server_keeps_serving(
    engine, case, body, status, needle
):
    if "model" not in body:
        body = {"model": engine.model, **body}
    code, out = await post(engine, "/v1/completions", body)
    assert code == status, out
    assert needle in out["error"]["message"]
    assert out["error"]["code"] == status
    ok, _ = await post(
        engine, "/v1/completions", {"model": engine.model, "prompt": "hi", "max_tokens": 1}
    )
    assert ok == 200


async def test_malformed_json_is_400(engine):
    code, out = await post(engine, "/v1/completions", None, raw=b"{not json")
    assert code == 400 and "error" in out


async def test_chat_with_tools_renders_the_template(engine, tiny_model):
    from transformers import AutoTokenizer

    tools = [{"type": "function", "function": {"name": "search", "description": "Search.",
              "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]  # fmt: skip
    messages = [
        {"role": "user", "content": "Find it."},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "a", "type": "function",
         "function": {"name": "search", "arguments": "{\"q\": \"x\"}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "found"},
    ]  # fmt: skip
    body = {"model": engine.model, "messages": messages, "tools": tools, "max_tokens": 5,
            "temperature": 0, "return_token_ids": True, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    status, out = await post(engine, "/v1/chat/completions", body)
    assert status == 200, out
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    parsed = [dict(m) for m in messages]
    parsed[1] = {
        **messages[1],
        "tool_calls": [
            {
                **messages[1]["tool_calls"][0],
                "function": {"name": "search", "arguments": {"q": "x"}},
            }
        ],
    }
    expected = tok.apply_chat_template(
        parsed, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert out["prompt_token_ids"] == tok.encode(expected, add_special_tokens=False)
    assert out["object"] == "chat.completion"
    [c] = out["choices"]
    assert c["message"]["role"] == "assistant"
    assert c["finish_reason"] in ("length", "stop", "tool_calls")
    assert len(c["token_ids"]) == len(c["logprobs"]["content"]) == out["usage"]["completion_tokens"]
    assert all(len(x["top_logprobs"]) == 2 for x in c["logprobs"]["content"])


async def _running(engine: Engine) -> float:
    async with aiohttp.ClientSession() as s, s.get(engine.url + "/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running")
    )


async def test_client_disconnect_aborts_the_request(engine):
    body = rollout_request(engine, PROMPTS[0], max_tokens=3000, ignore_eos=True)
    timeout = aiohttp.ClientTimeout(total=1.0)
    with pytest.raises(asyncio.TimeoutError):
        async with (
            aiohttp.ClientSession(timeout=timeout) as s,
            s.post(engine.url + "/v1/completions", json=body) as r,
        ):
            await r.read()
    async with asyncio.timeout(60):
        while await _running(engine) > 0:  # the server dropped it (it would run for long)
            await asyncio.sleep(0.2)
    code, _ = await post(engine, "/v1/completions", rollout_request(engine, PROMPTS[0]))
    assert code == 200


async def test_load_weights_switches_to_the_new_checkpoint_after_in_flight_requests(
    engine, reference, tiny_model, tiny_model_s1
):
    from libra.engine.weights import load_weights

    long = rollout_request(engine, PROMPTS[0], max_tokens=96)
    before = (await post(engine, "/v1/completions", long))[1]["choices"][0]["token_ids"]
    async with aiohttp.ClientSession() as s:
        try:
            in_flight = asyncio.create_task(post(engine, "/v1/completions", long))
            # Update only once the engine runs it (a fixed sleep raced a busy machine: the
            # request then arrived during the pause and ran wholly on the new weights).
            async with asyncio.timeout(60):
                while not in_flight.done() and await _running(engine) == 0:
                    await asyncio.sleep(0.02)
            result = await load_weights(s, engine.url, engine.kind, str(tiny_model_s1))
            assert result["status"] == "ok"
            # A request running during the update finished on the old weights, whole.
            assert (await in_flight)[1]["choices"][0]["token_ids"] == before
            out = (await post(engine, "/v1/completions", rollout_request(engine, PROMPTS)))[1]
            assert [c["token_ids"] for c in out["choices"]] == reference["s1"]
            assert reference["s1"] != reference["s0"]
            _, models = await post(
                engine, "/v1/completions", {"model": engine.model, "prompt": "x", "max_tokens": 1}
            )
            assert models["model"] == engine.model  # the served name does not change
        finally:
            await load_weights(s, engine.url, engine.kind, str(tiny_model))
    out = (await post(engine, "/v1/completions", rollout_request(engine, PROMPTS)))[1]
    assert [c["token_ids"] for c in out["choices"]] == reference["s0"]


async def test_load_weights_rejects_a_folder_that_is_not_a_model(engine, reference, tmp_path):
    from libra.engine.weights import load_weights
    from libra.errors import ConfigError

    async with aiohttp.ClientSession() as s:
        with pytest.raises(ConfigError, match="config.json"):
            await load_weights(s, engine.url, engine.kind, str(tmp_path))
    if engine.kind == "embedded":  # the server checks too (a client may skip the check)
        code, out = await post(engine, "/v1/load_weights", {"path": str(tmp_path)})
        assert code == 400 and "config.json" in out["error"]["message"]
    # Still serving, unpaused, on the weights it had.
    code, out = await post(engine, "/v1/completions", rollout_request(engine, PROMPTS))
    assert code == 200
    assert [c["token_ids"] for c in out["choices"]] == reference["s0"]


async def test_broadcast_weights_equal_the_same_weights_loaded_from_disk(
    engine, reference, tiny_model, tiny_model_s1
):
    """vLLM's weight-transfer phases with Libra's gloo engine (the embedded engine serves
    the same routes): the seed-1 tensors broadcast from this process give the greedy
    outputs the seed-1 folder gives (`reference`, which the folder-load test checks), a
    request running meanwhile finishes on the old weights, and broadcasting seed 0 back
    restores the original outputs. Nothing is written to disk."""
    from safetensors.torch import load_file

    from libra.endpoints.config import BucketConfig
    from libra.endpoints.pool import EndpointPool
    from libra.engine.weights import load_weights
    from libra.transfer.local import LocalSender
    from libra.weights import BroadcastSync, Weights

    tensors = {v: load_file(str(f / "model.safetensors")) for v, f in ((0, tiny_model),
               (1, tiny_model_s1))}  # fmt: skip
    now = {"v": 0}
    sender = LocalSender(lambda: tensors[now["v"] % 2], version=lambda: now["v"])
    bucket = BucketConfig(name="b", tp=engine.tp, bound=4096)
    async with EndpointPool([(bucket, [])], joined_later=True) as pool:
        sync = BroadcastSync(sender=sender, pool=pool, kind=engine.kind,  # type: ignore[arg-type]
                             origin=Weights(0, str(tiny_model)), ranks={"b": engine.tp})  # fmt: skip
        assert await sync.attach("b", engine.url, sync.start_weights()) == 0
        long = rollout_request(engine, PROMPTS[0], max_tokens=96)
        before = (await post(engine, "/v1/completions", long))[1]["choices"][0]["token_ids"]
        try:
            in_flight = asyncio.create_task(post(engine, "/v1/completions", long))
            async with asyncio.timeout(60):
                while not in_flight.done() and await _running(engine) == 0:
                    await asyncio.sleep(0.02)
            now["v"] = 1
            await sync.publish(1)
            assert (await in_flight)[1]["choices"][0]["token_ids"] == before
            out = (await post(engine, "/v1/completions", rollout_request(engine, PROMPTS)))[1]
            assert [c["token_ids"] for c in out["choices"]] == reference["s1"]
            assert [e.version for e in pool.endpoints()] == [1]
            now["v"] = 2
            await sync.publish(2)  # the same group, a second time
            out = (await post(engine, "/v1/completions", rollout_request(engine, PROMPTS)))[1]
            assert [c["token_ids"] for c in out["choices"]] == reference["s0"]
        finally:
            if now["v"] != 2 or sync.lost:
                async with aiohttp.ClientSession() as s:
                    await load_weights(s, engine.url, engine.kind, str(tiny_model))
