"""verifiers environments under `libra rollout` (issue 23, item 1): a single-turn and a
multi-turn tool environment written against verifiers 0.4's public API
(examples/verifiers_calc.py, tests/verifiers_envs/vf_chat.py; nothing downloaded) run as
`--env verifiers:MODULE`. verifiers'
own harness and MCP tool server run the episodes; the model is Libra's proxy in front of a
scripted engine (tests/fakes/vllm_fake.py: it calls `calculator` on "What is ...?" and
answers with the tool's result). The records have the native env's structure, the rewards
and metrics are the tasksets' own, and a task the taskset lacks is an episode error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from libra.errors import ConfigError
from tests.conftest import ROOT

pytest.importorskip("verifiers.v1")
ENVS = ROOT / "tests" / "verifiers_envs"
PATH = os.pathsep.join(str(p) for p in (ENVS, ROOT / "examples", ROOT))


def rollout(tmp: Path, url: str, env: str, *extra: str) -> list[dict[str, Any]]:
    out = tmp / f"{env.replace(':', '-')}.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "libra", "rollout", "--env", env, "--endpoint", f"tp1={url}",
         "--max-tokens", "64", "--out", str(out), *extra],
        cwd=tmp, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": PATH},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def shape(rec: dict[str, Any]) -> tuple[list[str], set[tuple[str, ...]]]:
    """The record's fields and its turns' fields."""
    return sorted(rec), {tuple(sorted(t)) for t in rec["turns"]}


def test_verifiers_envs_run_under_libra_rollout(tmp_path: Path, spawn_fake) -> None:
    url, _ = spawn_fake()
    native = rollout(tmp_path, url, "arith", "--num-tasks", "1")[0]

    calc = rollout(tmp_path, url, "verifiers:verifiers_calc", "--group-size", "2")
    assert len(calc) == 6 and {r["task_id"] for r in calc} == {"calc-0", "calc-1", "calc-2"}
    for rec in calc:
        assert rec["status"] == "ok", rec["error"]
        assert rec["env"] == "verifiers:verifiers_calc"
        # The taskset's reward and metric, through verifiers' own scoring.
        assert rec["reward"] == 1.0
        assert rec["reward_info"] == {"rewards": {"correct": 1.0}, "metrics": {"tool_turns": 1.0}}
        # Two model turns around one MCP tool call, recorded as a native env's are.
        first, last = rec["turns"]
        assert [c["name"] for c in first["tool_calls"]] == ["calculator"]
        assert [(t["tool"], t["status"]) for t in first["tool_returns"]] == [("calculator", "ok")]
        assert last["tool_calls"] == []
        n = len(rec["response_token_ids"])
        assert len(rec["loss_mask"]) == len(rec["logprobs"]) == n
        assert 0 in rec["loss_mask"] and rec["loss_mask"][-1] == 1  # tool tokens masked
        assert shape(rec) == shape(native)

    # A task is chosen from the taskset by id, never built from the task's fields.
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "chat-0"}\n{"id": "chat-1"}\n'
                     '{"id": "nope", "prompt": "x", "image": "evil"}\n')  # fmt: skip
    by_task = {r["task_id"]: r for r in rollout(tmp_path, url, "verifiers:vf_chat",
                                                "--tasks", str(tasks))}  # fmt: skip
    chat = [by_task["chat-0"], by_task["chat-1"]]
    assert all(r["status"] == "ok" and len(r["turns"]) == 1 for r in chat)
    # The scripted model says 42 to both: the rubric tells them apart.
    assert by_task["chat-0"]["reward"] == 1.0 and by_task["chat-1"]["reward"] == 0.0
    assert by_task["chat-0"]["reward_info"]["metrics"]["reply_chars"] > 0
    assert shape(by_task["chat-0"]) == shape(native)
    assert by_task["nope"]["status"] == "error"
    assert "not a task of verifiers taskset 'vf_chat'" in by_task["nope"]["error"]


def test_a_tasksets_task_list_is_kept_in_the_users_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`default_tasks()` writes the taskset's ids to the user's cache folder, not to a
    folder of the shared temp folder that another user could make first (and fill)."""
    from libra.rollout.run import load_env

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.syspath_prepend(str(ENVS))
    path = load_env("verifiers:vf_chat", {}).default_tasks()
    assert path.parent == tmp_path / "libra" / "verifiers-tasks"
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()][:2] == ["chat-0", "chat-1"]


def test_a_bad_verifiers_spec_is_one_clear_error() -> None:
    from libra.rollout.run import load_env

    with pytest.raises(ConfigError, match=r"verifiers env 'no_such_taskset'.*not found"):
        load_env("verifiers:no_such_taskset", {})
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['harnes'\]"):
        load_env("verifiers:vf_chat", {"harnes": "null"})


def test_serve_rollout_hosts_a_verifiers_env(tmp_path: Path, tiny_model: Path, spawn_fake,
                                             monkeypatch) -> None:  # fmt: skip
    """A client of `libra serve-rollout` picks verifiers tasks by id; an id the taskset
    lacks is an error record and the service goes on serving."""
    from libra.client import Client
    from tests.integration.service_util import Service

    url, _ = spawn_fake()
    monkeypatch.setenv("PYTHONPATH", PATH)
    svc = Service(tmp_path, tiny_model, [url], "--env", "calc=verifiers:verifiers_calc")
    svc.start()
    try:
        with Client(svc.url, reconnect_s=5) as c:
            recs = list(c.trajectories(c.submit("calc", [{"id": "calc-1"}, {"id": "nope"}],
                                                group_size=2)))  # fmt: skip
            by = {(r.task_id, r.status) for r in recs}
            assert by == {("calc-1", "ok"), ("nope", "error")} and len(recs) == 4
            assert all(r.reward == 1.0 for r in recs if r.task_id == "calc-1")
            again = list(c.trajectories(c.submit("calc", [{"id": "calc-2"}])))
            assert [(r.status, r.reward) for r in again] == [("ok", 1.0)]
    finally:
        svc.close()
