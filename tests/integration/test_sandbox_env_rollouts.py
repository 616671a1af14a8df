"""A `libra rollout` batch on each built-in env, end to end against the embedded engine
(the tiny random model, so rewards are ~0): records come out whole, every sandbox an
episode made is gone afterwards."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from libra.sandboxes.bwrap import BwrapBackend

from libra.endpoints.config import BucketConfig, SamplingConfig
from libra.rollout import RolloutConfig, rollout
from libra.rollout.config import LimitsConfig
from tests.conftest import need


@pytest.mark.slow
@pytest.mark.parametrize("env", ["search-qa", "math", "swe-repair"])
async def test_rollout_batch_runs_end_to_end(
    env: str, tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = {}
    if env == "swe-repair":
        need(BwrapBackend.available() is None, "bubblewrap unavailable")
        state = tmp_path / "bwrap"
        monkeypatch.setenv("LIBRA_BWRAP_STATE", str(state))
        options = {"backend": "bwrap", "test_timeout_s": 120}
    out = tmp_path / "out.jsonl"
    cfg = RolloutConfig(
        model=str(tiny_model),
        env=env,
        env_options=options,
        num_tasks=2,
        group_size=2,
        out=str(out),
        buckets=[BucketConfig(name="tp1", tp=1, launch=1)],
        sampling=SamplingConfig(max_tokens=48, seed=0),
        limits=LimitsConfig(max_turns=2),
    )
    summary = await rollout(cfg, progress=False)
    assert summary["episodes"] == 4
    records = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert len(records) == 4 and {r["env"] for r in records} == {env}
    for r in records:
        assert r["status"] in ("ok", "truncated"), r.get("error")
        assert 0.0 <= r["reward"] <= 1.0 and r["reward_info"] is not None
        assert len(r["response_token_ids"]) == len(r["loss_mask"]) == len(r["logprobs"])
    if env == "swe-repair":
        # the reward ran the project's tests in each episode's sandbox ...
        assert all(r["reward_info"]["tests_passed"] > 0 for r in records)
        # ... and teardown removed every sandbox
        assert not any(state.glob("lb-*"))
