"""User code that misbehaves inside an episode (issue 14, items 2 and 3): the failure is
the episode's data, limits hold whatever the code does, and nothing it does stalls the
event loop. A real `libra rollout` against the fake vLLM server on loopback; the scripted
model calls `calculator` once, then answers with what it returned."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import orjson

import libra
from libra import registry
from libra.chat import ChatTokenizer
from libra.endpoints.config import BucketConfig
from libra.record import Trajectory, read_jsonl
from libra.rollout import rollout
from tests.integration.test_rollout import cfg


class BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


class BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class Halt(BaseException):
    """A BaseException of the env's own (not an Exception)."""


RELEASE = threading.Event()
"""Set at the end of a test: stops tools that ignore cancellation."""
HUGE = "word " * (4 * 1024 * 1024 // 5)


def loop_answers(loop: asyncio.AbstractEventLoop) -> bool:
    """From a thread: whether the event loop runs a callback while this thread waits (it
    cannot if this code blocks the loop itself)."""
    ran = threading.Event()
    loop.call_soon_threadsafe(ran.set)
    return ran.wait(5)


@libra.tool(timeout=1)
async def calculator(expression: str, ctx: libra.Context) -> Any:
    """Evaluate an expression, misbehaving as the task says.

    Args:
        expression: what to evaluate.
    """
    mode = ctx.task["mode"]
    if mode == "unserialisable":
        return {"value": object()}
    if mode == "bad-result":
        return libra.ToolResult(content=42, status="ok")  # type: ignore[arg-type]
    if mode in ("swallow", "swallow-episode"):
        for _ in range(200):  # ignores cancellation until the test ends
            if RELEASE.is_set():
                break
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                continue
        return "5"
    if mode == "huge":
        return HUGE
    if mode == "exit":
        raise SystemExit(3)
    if mode == "halt":
        raise Halt("stop everything")
    if mode == "bad-str":
        raise BadStr
    if mode == "surrogate":  # a str no UTF-8 can hold
        return "5\ud800"
    if mode == "bad-repr-info":
        return libra.ToolResult("5", info={"n": 1, "obj": BadRepr()})
    return "5"


@libra.tool(timeout=5)
def sync_calculator(expression: str, ctx: libra.Context) -> str:
    """Evaluate an expression in a blocking function.

    Args:
        expression: what to evaluate.
    """
    mode = ctx.task["mode"]
    if mode == "sync-stop":
        return next(iter(()))  # StopIteration cannot cross into an asyncio future
    if mode == "sync-cancel":
        raise asyncio.CancelledError
    return "5" if loop_answers(ctx.state["loop"]) else "blocked"


class Faulty(libra.Env):
    """Each task's `mode` picks what goes wrong. Its hooks are plain (blocking) functions."""

    tools = [calculator]
    max_turns = 3

    def tools_for(self, task: dict[str, Any]) -> list[libra.Tool]:
        if task["mode"].startswith("sync"):
            return [libra.tool(name="calculator")(sync_calculator.fn)]
        return [calculator]

    async def setup(self, ctx: libra.Context) -> None:
        ctx.state["loop"] = self.loop = asyncio.get_running_loop()

    def parse_answer(self, text: str) -> str | None:
        # A blocking parser: its answer only if the loop ran a callback while it waited
        # (it ran on the loop before: every turn blocked it, for 5 s here).
        answer = super().parse_answer(text)
        return answer if answer is None or loop_answers(self.loop) else "blocked"

    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "What is 2 + 3?"}]

    def reward(self, task: dict[str, Any], trajectory: Any, ctx: libra.Context) -> Any:  # type: ignore[override]
        mode = task["mode"]
        if mode == "nan-reward":
            return float("nan")
        if mode == "huge-reward":  # finite, but past float32, the trainer's arithmetic
            return 1e39
        if mode == "odd-info":
            return 1.0, {"obj": object(), "n": 2}
        if mode == "huge-info":  # a 10 MB log among the components
            return 1.0, {"n": 2, "log": "x" * (10 << 20), "m": 3}
        if mode == "interrupt-reward":
            raise KeyboardInterrupt
        if mode == "mutate-record":  # what it changes is its copy's
            trajectory.group_id, trajectory.status = "another group", "bogus"
            trajectory.loss_mask[:] = []
            trajectory.id = object()
            return 1.0
        # A blocking reward: it holds its thread until the loop has run a callback.
        return float(loop_answers(ctx.state["loop"]))


MODES = ["plain", "sync", "unserialisable", "bad-result", "swallow", "nan-reward", "huge-reward",
         "odd-info", "huge-info"]  # fmt: skip


async def run_modes(tmp_path: Path, model: Path, url: str, modes: list[str], **kw: Any) -> dict:
    RELEASE.clear()
    registry.envs.register("test-faulty", Faulty())
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(b"".join(orjson.dumps({"id": m, "mode": m}) + b"\n" for m in modes))
    c = cfg(tmp_path, model, [BucketConfig(name="tp1", endpoints=[url])], env="test-faulty",
            tasks=str(tasks), concurrency=len(modes), **kw)  # fmt: skip
    try:
        await rollout(c, progress=False)
    finally:
        RELEASE.set()
    return {r.task_id: r for r in read_jsonl(c.out)}


def shown(rec: Trajectory, tok: ChatTokenizer) -> str:
    """The tool response of the first turn as the model saw it."""
    t = rec.turns[0]
    return tok.decode(rec.response_token_ids[t.model_tokens : t.model_tokens + t.tool_tokens])


async def test_faulty_user_code_is_data_and_limits_hold(
    tmp_path: Path, tiny_model: Path, fake_vllm
) -> None:
    recs = await run_modes(tmp_path, tiny_model, fake_vllm.url, MODES)
    tok = ChatTokenizer(tiny_model)
    returns = {m: r.turns[0].tool_returns[0] for m, r in recs.items()}
    # Blocking hooks, tools and the env's answer parser ran beside the loop, which kept
    # running.
    for mode in ("plain", "sync"):
        assert recs[mode].status == "ok" and recs[mode].reward == 1.0, recs[mode].error
        assert returns[mode].status == "ok" and recs[mode].answer == "5"
    # A tool's bad return value is that call's error; the episode goes on.
    for mode, why in (("unserialisable", "not JSON-serialisable"),
                      ("bad-result", "content is a int")):  # fmt: skip
        assert recs[mode].status == "ok", recs[mode].error
        assert returns[mode].status == "error" and why in shown(recs[mode], tok)
        assert len(recs[mode].turns) == 2
    # A tool that swallows cancellation still ends `timeout` at its limit.
    assert returns["swallow"].status == "timeout" and recs["swallow"].status == "ok"
    assert "timed out after 1 s" in shown(recs["swallow"], tok)
    # A reward that is not a finite number is the episode's error, with the reason.
    assert recs["nan-reward"].status == "error"
    assert "finite" in (recs["nan-reward"].error or "")
    assert recs["huge-reward"].status == "error"
    assert "magnitude must be at most 1e+38" in (recs["huge-reward"].error or "")
    # Reward components JSON cannot hold reach the record as text.
    info = recs["odd-info"].reward_info or {}
    assert recs["odd-info"].status == "ok" and info["n"] == 2
    assert str(info["obj"]).startswith("<object object")
    # Components past 64 KiB: the ones that fit stay, the 10 MB log is a note.
    info = recs["huge-info"].reward_info or {}
    assert recs["huge-info"].status == "ok" and info["n"] == 2 and info["m"] == 3
    assert info["log"] == "<a str of 10,485,762 bytes as JSON, not kept: info keeps 65,536>"


RAISES = ["plain", "exit", "halt", "bad-str", "sync-stop", "sync-cancel", "interrupt-reward"]


async def test_whatever_user_code_raises_is_the_episode_s_data(
    tmp_path: Path, tiny_model: Path, fake_vllm
) -> None:
    """A SystemExit, KeyboardInterrupt or BaseException of its own from a tool or reward
    ended the whole batch (the process exited, the other episodes lost); a StopIteration
    from a plain tool hung to its limit; a CancelledError from one read as the batch's
    cancellation; an exception whose str() raises ended the episode."""
    recs = await run_modes(tmp_path, tiny_model, fake_vllm.url, RAISES,
                           limits={"tool_timeout_s": 30})  # fmt: skip
    tok = ChatTokenizer(tiny_model)
    assert set(recs) == set(RAISES) and recs["plain"].reward == 1.0
    for mode, why in (
        ("exit", "raised SystemExit: 3"),
        ("halt", "raised Halt: stop everything"),
        ("bad-str", "raised BadStr <its str() raised RuntimeError>"),
        ("sync-stop", "raised StopIteration"),
        ("sync-cancel", "raised CancelledError"),
    ):
        ret = recs[mode].turns[0].tool_returns[0]
        assert recs[mode].status == "ok" and ret.status == "error", (mode, recs[mode].error)
        assert why in shown(recs[mode], tok), mode
        assert ret.latency_s < 5, mode  # not at the 30-s limit
    rec = recs["interrupt-reward"]
    assert (rec.status, rec.reward) == ("error", 0.0)
    assert rec.error == "reward failed: env.reward raised KeyboardInterrupt", rec.error


async def test_a_reward_that_changes_the_record_changes_a_copy(
    tmp_path: Path, tiny_model: Path, fake_vllm
) -> None:
    """The reward got the record itself: a `group_id` it set was written (other tasks'
    episodes in one GRPO group), a status or mask it set broke the record's schema, and
    an id JSON cannot hold lost the record and ended the batch with a traceback."""
    recs = await run_modes(tmp_path, tiny_model, fake_vllm.url, ["plain", "mutate-record"])
    rec, plain = recs["mutate-record"], recs["plain"]
    assert (rec.status, rec.reward) == ("ok", 1.0), rec.error
    assert rec.group_id.endswith("/mutate-record") and rec.id.startswith(rec.group_id)
    assert len(rec.loss_mask) == len(rec.response_token_ids) == len(plain.response_token_ids)


async def test_the_episode_limit_holds_over_a_tool_that_ignores_cancellation(
    tmp_path: Path, tiny_model: Path, fake_vllm
) -> None:
    recs = await run_modes(tmp_path, tiny_model, fake_vllm.url, ["swallow-episode"],
                           limits={"episode_timeout_s": 0.5, "tool_timeout_s": 30})  # fmt: skip
    rec = recs["swallow-episode"]
    assert rec.status == "timeout" and "episode exceeded 0.5 s" in (rec.error or "")


async def test_a_huge_tool_return_is_cut_and_tokenized_off_the_loop(
    tmp_path: Path, tiny_model: Path, fake_vllm
) -> None:
    cpu = time.thread_time()  # CPU of this (the event loop's) thread, not wall time
    recs = await run_modes(tmp_path, tiny_model, fake_vllm.url, ["huge"])
    loop_cpu = time.thread_time() - cpu
    rec = recs["huge"]
    ret = rec.turns[0].tool_returns[0]
    assert (ret.info or {})["output_cut_chars"] == len(HUGE)
    # 256 KiB of it is tens of thousands of tokens: more than the tiny model's context.
    assert rec.status == "truncated" and "overflows" in (rec.error or "")
    # Tokenizing 4 MB on the loop costs it ~6 s of CPU; cut and off the loop, a fraction.
    assert loop_cpu < 1.5, loop_cpu


STUCK_ENV = '''
import asyncio
import time

import libra


@libra.tool(timeout=1)
def calculator(expression: str) -> str:
    """Blocks its thread for an hour: a thread cannot be killed.

    Args:
        expression: what to evaluate.
    """
    time.sleep(3600)
    return "5"


class Stuck(libra.Env):
    tools = [calculator]
    max_turns = 2

    def prompt(self, task):
        return [{"role": "user", "content": "What is 2 + 3?"}]

    async def reward(self, task, trajectory):
        while True:  # ignores its cancellation for ever
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass
'''


def test_libra_rollout_exits_when_user_code_never_returns(
    tmp_path: Path, tiny_model: Path, spawn_fake
) -> None:
    """A tool stuck in its thread and a reward that ignores cancellation: the command
    still writes every record, prints its summary and exits (it hung at exit: the
    interpreter joined the stuck thread, asyncio waited for the task)."""
    import subprocess
    import sys

    url, _ = spawn_fake()
    (tmp_path / "stuck.py").write_text(STUCK_ENV)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(b"".join(orjson.dumps({"id": f"q{i}"}) + b"\n" for i in range(2)))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "libra", "rollout", "--env", f"{tmp_path}/stuck.py:Stuck",
           "--tasks", str(tasks), "--model", str(tiny_model), "--endpoint",
           f"tp1={url}", "--out", str(out), "--quiet", "--json",
           "--set", "limits.reward_timeout_s=1"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    assert orjson.loads(p.stdout)["episodes"] == 2
    assert "calls of user code were still running past their limits" in p.stderr
    recs = read_jsonl(out)
    assert len(recs) == 2
    for r in recs:
        assert r.turns[0].tool_returns[0].status == "timeout"
        assert (r.status, r.error) == ("error", "reward exceeded 1 s")


def calc_tool(value: str) -> libra.Tool:
    """A fresh `calculator` tool object that answers `value`."""

    def calculator(expression: str, ctx: libra.Context) -> str:
        """Answer the task's value.

        Args:
            expression: ignored.
        """
        ctx.task["calls"].append(value)  # a tool writing to its task
        return value

    return libra.tool(name="calculator")(calculator)


A_TOOL, B_TOOL = calc_tool("7"), calc_tool("9")


class Varied(libra.Env):
    """`tools_for` gives each task a fresh list of one of two tools."""

    max_turns = 3

    def tools_for(self, task: dict[str, Any]) -> list[libra.Tool]:
        return [A_TOOL if task["kind"] == "a" else B_TOOL]

    def prompt(self, task: dict[str, Any]) -> Any:
        if task["kind"] == "text":
            return "What is 2 + 3?"  # a str, not messages
        return [{"role": "user", "content": "What is 2 + 3?"}]

    def reward(self, task: dict[str, Any], trajectory: Any) -> Any:  # type: ignore[override]
        return 1.0, {"calls": list(task["calls"])}


async def test_each_episode_gets_its_task_s_tools_and_a_task_of_its_own(
    tmp_path: Path, tiny_model: Path, fake_vllm
) -> None:
    """Two bugs seen by a hostile env: schemas were cached by the id of the list
    `tools_for` returned, so a fresh list of another task's tools could get a freed
    list's entry (the prompt offered one tool, the call ran the other: 499 of 1,000
    calls in a direct check); and a group's episodes shared one task dict, so what one
    wrote to `ctx.task` its siblings saw. A prompt that is not messages is an error."""
    registry.envs.register("test-varied", Varied())
    kinds = ["a", "b"] * 12 + ["text"]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(b"".join(orjson.dumps({"id": f"{k}{i}", "kind": k, "calls": []}) + b"\n"
                               for i, k in enumerate(kinds)))  # fmt: skip
    c = cfg(tmp_path, tiny_model, [BucketConfig(name="tp1", endpoints=[fake_vllm.url])],
            env="test-varied", tasks=str(tasks), concurrency=1, group_size=2)  # fmt: skip
    await rollout(c, progress=False)
    recs = read_jsonl(c.out)
    assert len(recs) == 2 * len(kinds)
    for r in recs:
        if r.task_id.startswith("text"):
            assert r.status == "error" and r.error == (
                "TypeError: env.prompt returned a str; return a list of chat messages: "
                '[{"role": "user", "content": "..."}]'
            )
            continue
        want = "7" if r.task_id.startswith("a") else "9"
        assert r.status == "ok" and r.answer == want, (r.task_id, r.answer)
        assert (r.reward_info or {})["calls"] == [want]  # its own copy of the task


CHATTY_ENV = '''
import libra


@libra.tool
def calculator(expression: str) -> str:
    """Prints as it works.

    Args:
        expression: what to evaluate.
    """
    print("debug: evaluating", expression)
    return "5"


class Chatty(libra.Env):
    tools = [calculator]

    def prompt(self, task):
        print("debug: a prompt")
        return [{"role": "user", "content": "What is 2 + 3?"}]

    def reward(self, task, trajectory):
        print("debug: scoring")
        return 1.0
'''


def test_what_an_env_prints_does_not_break_json_output(
    tmp_path: Path, tiny_model: Path, spawn_fake
) -> None:
    """`--json` promises one JSON document on stdout; an env's `print` went there too."""
    import subprocess
    import sys

    url, _ = spawn_fake()
    (tmp_path / "chatty.py").write_text(CHATTY_ENV)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(orjson.dumps({"id": "q0"}) + b"\n")
    cmd = [sys.executable, "-m", "libra", "rollout", "--env", f"{tmp_path}/chatty.py:Chatty",
           "--tasks", str(tasks), "--model", str(tiny_model), "--endpoint", f"tp1={url}",
           "--out", str(tmp_path / "out.jsonl"), "--quiet", "--json"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    assert orjson.loads(p.stdout)["episodes"] == 1, p.stdout[:500]
    assert "debug: scoring" in p.stderr and "debug: evaluating" in p.stderr


async def test_odd_tool_returns_are_cleaned_not_the_episode_s_end(
    tmp_path: Path, tiny_model: Path, fake_vllm
) -> None:
    """A lone surrogate in a tool's text (the tokenizer refused it) and info whose repr
    raises each ended the whole episode `error`."""
    recs = await run_modes(tmp_path, tiny_model, fake_vllm.url, ["surrogate", "bad-repr-info"])
    tok = ChatTokenizer(tiny_model)
    for mode in ("surrogate", "bad-repr-info"):
        rec = recs[mode]
        assert rec.status == "ok" and rec.turns[0].tool_returns[0].status == "ok", rec.error
    assert "5?" in shown(recs["surrogate"], tok)
    info = recs["bad-repr-info"].turns[0].tool_returns[0].info or {}
    assert info == {"n": 1, "obj": "<a BadRepr whose repr() raised RuntimeError>"}, info


async def test_info_dicts_go_to_json_off_the_event_loop(
    tmp_path: Path, tiny_model: Path, fake_vllm, monkeypatch
) -> None:
    """A tool's and a reward's info dicts were made JSON-safe on the event loop: 200 MB
    of info stalled every episode for seconds. They are now made so in a thread."""
    from libra.rollout import episode, reward

    threads: list[str] = []
    real = reward.plain

    def watched(info: Any) -> Any:
        if info:  # None or {} costs nothing
            threads.append(threading.current_thread().name)
        return real(info)

    monkeypatch.setattr(reward, "plain", watched)
    monkeypatch.setattr(episode, "plain", watched)
    recs = await run_modes(tmp_path, tiny_model, fake_vllm.url, ["huge-info", "bad-repr-info"])
    assert recs["huge-info"].reward_info["n"] == 2  # type: ignore[index]
    assert (recs["bad-repr-info"].turns[0].tool_returns[0].info or {})["n"] == 1
    loop_thread = threading.main_thread().name
    assert threads and loop_thread not in threads, threads
