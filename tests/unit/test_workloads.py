"""Workload generators: records a consumer can trust, and the causal shape they claim."""

from __future__ import annotations

import numpy as np
import pytest

from libra.errors import ConfigError
from libra.record import Trajectory
from libra.sim import workloads

NAMES = ["search-r1", "r2e-gym", "dapo-math"]


def _time(rec: Trajectory) -> float:
    """Rollout time of one episode: per-token decode cost grows with the context so
    that 1K -> 32K tokens is ~95x slower (DESIGN.md), plus tool wall time."""
    ctx, t = rec.prompt_tokens, 0.0
    for turn in rec.turns:
        t += turn.model_tokens * (1 + (ctx + turn.model_tokens / 2) / 8192) * 0.02
        ctx += turn.model_tokens + turn.tool_tokens
        t += sum(r.latency_s for r in turn.tool_returns)
    return t


@pytest.mark.parametrize("name", NAMES)
def test_records_follow_the_schema_and_add_up(name):
    recs = workloads.sample(name, 4, 3, step=2, seed=1)
    spec = workloads.spec(name)
    assert len(recs) == 12
    assert [r.seq for r in recs] == list(range(12))
    for rec in recs:
        again = Trajectory.from_json(rec.to_json())  # validates every field
        assert again.model_dump() == rec.model_dump()
        assert rec.step == 2 and rec.env == name
        offset = 0
        for turn in rec.turns:
            assert turn.start == offset and turn.model_tokens >= 1
            offset += turn.model_tokens + turn.tool_tokens
            for ret in turn.tool_returns:
                assert ret.status in ("ok", "error", "timeout") and ret.payload_tokens >= 1
        assert rec.total_tokens == rec.prompt_tokens + offset <= spec.max_context
        assert rec.turns[-1].tool_returns == [] or rec.status == "truncated"
        assert (rec.status == "truncated") == (rec.total_tokens == spec.max_context)
    # a group is one prompt sampled `group` times
    assert len({r.task_id for r in recs[:3]}) == 1 and len({r.group_id for r in recs}) == 4


def test_same_arguments_same_trace_and_seed_changes_it():
    a = [r.to_json() for r in workloads.sample("search-r1", 3, 4, step=5, seed=7)]
    b = [r.to_json() for r in workloads.sample("search-r1", 3, 4, step=5, seed=7)]
    c = [r.to_json() for r in workloads.sample("search-r1", 3, 4, step=5, seed=8)]
    assert a == b and a != c


def test_prompts_recur_once_per_epoch_with_fixed_latents():
    params = {"dataset_size": 8}
    steps = [workloads.sample("search-r1", 4, 2, step=s, seed=0, params=params) for s in range(4)]
    epoch0 = {r.task_id for s in steps[:2] for r in s}
    epoch1 = {r.task_id for s in steps[2:] for r in s}
    assert len(epoch0) == 8 and epoch0 == epoch1
    prompt_len = {}
    for r in (r for s in steps for r in s):
        assert prompt_len.setdefault(r.task_id, r.prompt_tokens) == r.prompt_tokens


def test_unknown_names_and_bad_overrides_are_one_clear_error():
    with pytest.raises(ConfigError, match="known: search-r1, r2e-gym, dapo-math"):
        workloads.sample("search-r2", 1, 1)
    with pytest.raises(ConfigError, match="has no field .no_such_field."):
        workloads.sample("search-r1", 1, 1, params={"no_such_field": 1})
    with pytest.raises(ConfigError, match="n_prompts"):
        workloads.sample("search-r1", 0, 1)


def _batch(name, steps=range(4), n=32, group=8, seed=3):
    return [r for s in steps for r in workloads.sample(name, n, group, step=s, seed=seed)]


def test_failures_bring_extra_turns():
    recs = _batch("search-r1")
    failed = [
        len(r.turns) for r in recs if any(t.status != "ok" for u in r.turns for t in u.tool_returns)
    ]
    clean = [
        len(r.turns) for r in recs if all(t.status == "ok" for u in r.turns for t in u.tool_returns)
    ]
    assert len(failed) > 50 and np.mean(failed) > np.mean(clean) + 1


def test_large_payloads_lengthen_the_next_turn():
    recs = _batch("r2e-gym")
    after_small, after_large = [], []
    for r in recs:
        for prev, nxt in zip(r.turns, r.turns[1:], strict=False):
            payload = sum(t.payload_tokens for t in prev.tool_returns)
            (after_large if payload > 2000 else after_small).append(nxt.model_tokens)
    assert len(after_large) > 30
    assert np.median(after_large) > 2 * np.median(after_small)


def test_r2e_gym_is_heavy_tailed():
    # DESIGN.md: on R2E-Gym the longest 10% of trajectories take over 50% of rollout time.
    times = np.sort([_time(r) for r in _batch("r2e-gym", steps=range(6), n=48, group=16)])
    top = times[-len(times) // 10 :].sum() / times.sum()
    assert top > 0.5


def test_search_r1_first_bucket_share_is_near_the_papers():
    # The paper's MLFQ scores 44.8%, which its definition makes the share of
    # episodes below the first bound (5,000 tokens).
    totals = np.array([r.total_tokens for r in _batch("search-r1", steps=range(6), n=48)])
    assert 0.38 < (totals <= 5000).mean() < 0.52


def test_prompts_differ_in_difficulty():
    recs = _batch("search-r1", steps=[0], n=64, group=16)
    by_task: dict[str, list[int]] = {}
    for r in recs:
        by_task.setdefault(r.task_id, []).append(np.log(r.total_tokens))
    means = np.array([np.mean(v) for v in by_task.values()])
    within = np.mean([np.var(v) for v in by_task.values()])
    # between-prompt spread well above what 16 samples of one distribution would show
    assert np.var(means) > 3 * within / 16


@pytest.mark.parametrize("name", NAMES)
def test_drift_over_training_steps(name):
    early = _batch(name, steps=[0, 1], n=48)
    late = _batch(name, steps=[400, 401], n=48)

    def per_turn(recs):  # the first turn: every episode has one
        return np.median([r.turns[0].model_tokens for r in recs])

    def format_errors(recs):
        rets = [t for r in recs for u in r.turns for t in u.tool_returns]
        return np.mean([t.status == "error" for t in rets]) if rets else 0.0

    assert per_turn(late) > 1.2 * per_turn(early)
    if name == "search-r1":  # its only errors are malformed calls
        assert format_errors(late) < 0.5 * format_errors(early)


def test_workload_command_writes_what_sample_returns(tmp_path, capsys):
    import gzip

    from libra.cli import main

    out = tmp_path / "t.jsonl.gz"
    args = ["workload", "dapo-math", "--out", str(out), "--steps", "2", "--prompts", "3"]
    assert main([*args, "--group", "2", "--seed", "4", "--param", "dataset_size=5"]) == 0
    with gzip.open(out) as f:
        got = [Trajectory.from_json(line) for line in f]
    want = [
        r
        for s in range(2)
        for r in workloads.sample("dapo-math", 3, 2, step=s, seed=4, params={"dataset_size": 5})
    ]
    assert [g.model_dump(exclude={"seq"}) for g in got] == [
        w.model_dump(exclude={"seq"}) for w in want
    ]
    assert [g.seq for g in got] == list(range(12))
    assert main(["workload", "dapo-math", "--out", str(out), "--param", "max_turns=2.5"]) == 2
    assert "max_turns must be of type int" in capsys.readouterr().err


def test_frozen_traces_are_what_the_script_writes():
    # tests/data was written by tests/data/make_traces.py before any policy was tuned;
    # this keeps the generator from drifting away from the frozen files unnoticed.
    import gzip
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "data" / "make_traces.py"
    mod_spec = importlib.util.spec_from_file_location("make_traces", path)
    assert mod_spec and mod_spec.loader
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    for file, (name, _steps, prompts, group, seed, params) in mod.TRACES.items():
        with gzip.open(path.parent / file) as f:
            frozen = f.readline()
        first = workloads.sample(name, prompts, group, step=0, seed=seed, params=params)[0]
        assert Trajectory.from_json(frozen).model_dump() == first.model_dump(), file
