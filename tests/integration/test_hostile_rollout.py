"""Hostile code run by a model inside a `libra rollout`: every limit acting is reported
on the trajectory (tool status + `info`), the batch goes on, and no sandbox is left."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest
from libra.sandboxes.auto import open_backend
from libra.sandboxes.base import SandboxSpec
from libra.tools.shell import bash

import libra
from libra import registry
from libra.chat import ChatTokenizer
from libra.endpoints.config import BucketConfig
from libra.record import read_jsonl
from libra.rollout import RolloutConfig, rollout
from tests.contracts.sandbox_fixtures import BACKENDS, start_backend


class Shell(libra.Env):
    """One sandbox per episode; the model may run `bash` in it."""

    tools = [bash]
    max_turns = 3

    def __init__(self, backend: str = "bwrap", **options: Any):
        super().__init__(**options)
        self.backend_name = backend
        self._backend: Any = None
        self.created: list[Any] = []

    async def setup(self, ctx: libra.Context) -> None:
        if self._backend is None:
            self._backend = await open_backend(self.backend_name)
        ctx.sandbox = await self._backend.create(
            SandboxSpec(image="busybox", memory_mb=64, pids=64)
        )
        self.created.append(ctx.sandbox)

    async def teardown(self, ctx: libra.Context) -> None:
        await ctx.sandbox.close()

    async def close(self) -> None:
        if self._backend is not None:
            await self._backend.aclose()

    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": task["question"]}]


@pytest.mark.slow
@pytest.mark.parametrize("backend_name", BACKENDS)
async def test_limits_show_on_the_trajectory(
    backend_name: str, tmp_path: Path, tiny_model: Path, fake_vllm, monkeypatch
) -> None:
    probe = await start_backend(backend_name, tmp_path)  # skips (locally) when unavailable
    await probe.aclose()
    monkeypatch.setenv("LIBRA_BWRAP_STATE", str(tmp_path / "bwrap-state"))
    env = Shell(backend=backend_name)
    registry.envs.register("test-shell", env)
    kinds = ["oom", "fork", "loop", "flood"]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(
        b"".join(
            orjson.dumps({"id": k, "question": f"DIRECTIVE:hostile-{k}"}) + b"\n" for k in kinds
        )
    )
    cfg = RolloutConfig(
        model=str(tiny_model), env="test-shell", tasks=str(tasks), out=str(tmp_path / "o.jsonl"),
        buckets=[BucketConfig(name="tp1", endpoints=[fake_vllm.url])], concurrency=4,
    )  # fmt: skip
    await rollout(cfg, progress=False)
    recs = {r.task_id: r for r in read_jsonl(cfg.out)}
    assert set(recs) == set(kinds)
    tok = ChatTokenizer(tiny_model)
    seen: dict[str, tuple[str, dict[str, Any], str]] = {}
    for kind, r in recs.items():
        # The episode went on and answered; 8 KiB of flood output is more than the tiny
        # model's 4,096-token context, so that one ends `truncated` (tool return kept).
        assert r.status == ("truncated" if kind == "flood" else "ok"), r.error
        (ret,) = r.turns[0].tool_returns
        assert ret.tool == "bash" and ret.info is not None
        shown = tok.decode(
            r.response_token_ids[
                r.turns[0].model_tokens : r.turns[0].model_tokens + r.turns[0].tool_tokens
            ]
        )
        seen[kind] = (ret.status, ret.info, shown)
    status, info, shown = seen["oom"]
    # The kernel picks the victim: usually `tail` (then the shell echoes exit=137), under
    # memory pressure sometimes the shell itself (then the command's own code is 137).
    # Either way the model is told that the OOM killer acted and with which code.
    assert info["oom_killed"] and "killed by the OOM killer" in shown and "137" in shown
    status, info, shown = seen["fork"]  # the refused fork, as the model saw it
    assert "can't fork" in shown or "Resource temporarily unavailable" in shown
    status, info, shown = seen["loop"]
    assert status == "timeout" and info["timed_out"] and info["exit_code"] == 137
    status, info, shown = seen["flood"]
    assert status == "error" and info["flooded"] and info["stdout_bytes"] < 100_000_000
    # every sandbox is closed (teardown) and the backend is gone (env.close at the end)
    assert len(env.created) == 4 and all(sb.closed for sb in env.created)
    await asyncio.sleep(0)
