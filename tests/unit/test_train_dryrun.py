"""`libra train --dry-run` shows one layout, the one a run starts with (the [fleet]
section, as `libra.train.placement` places it), says what would stop the run, and shows
the global planner's split only as advice, never mixed into the layout."""

from __future__ import annotations

from collections import Counter

from libra.train import load_config
from libra.train import placement as pl
from libra.train.dryrun import describe, render
from tests.conftest import ROOT


def test_the_layout_is_what_a_run_places_and_the_plan_is_labelled_advice() -> None:
    cfg = load_config(ROOT / "examples/search-r1-gpu48.toml")
    doc = describe(cfg)
    lay = doc["layout"]
    # the run's own workers at start (no warm start: the hybrids serve rollouts)
    workers = pl.workers(cfg, hybrids_training=0)
    serving = Counter(w.bucket for w in workers if w.role == "rollout")
    assert {b["name"]: b["core"] + b["hybrids"] for b in lay["buckets"]} == serving == {"tp8": 5}
    assert lay["training_replicas"] == sum(w.role == "train" for w in workers) == 1
    assert lay["rollout_devices"] == sum(pl.instances(cfg)) == 40
    assert lay["problem"].startswith("fleet.vllm.gpus: list the GPU ids")  # none configured
    assert doc["plan"]["applied"] is False

    text = render(doc).splitlines()
    cut = next(i for i, line in enumerate(text) if "planner's split" in line)
    layout, plan = text[:cut], text[cut:]
    assert "advice, not applied: a run keeps the layout above" in plan[0]
    assert "  rollout, bucket tp8: 5 x TP8 vLLM instances (2 core + 3 hybrid)" in layout
    assert any(line.startswith("  a run stops here: fleet.vllm.gpus") for line in layout)
    # the planner's TP mix (2 x TP2, 1 x TP4, 3 x TP8 here) appears only under its label
    assert not any(f"TP{tp}" in line for line in layout for tp in (2, 4))
    assert any("TP2" in line for line in plan)


def test_a_runnable_gpu_config_has_no_problem_and_an_embedded_one_no_plan() -> None:
    doc = describe(load_config(ROOT / "examples/search-r1-gpu8.toml"))
    assert doc["layout"]["problem"] is None
    assert "a run stops here" not in render(doc)
    cpu = describe(load_config(ROOT / "examples/cpu-train.toml"))
    assert "plan" not in cpu and cpu["layout"]["engine"] == "embedded"
    assert "  rollout, bucket tp1: 1 embedded engine (1 core)" in render(cpu)
    assert "the planner places the hybrids at start, on the demonstrations" in render(cpu)


def test_every_gpu_example_is_timed_finite_with_the_sharding_that_runs() -> None:
    """The run's own planner times every assignment of every GPU example with the
    training the trainer runs: replicas of `replica_ranks` GPUs, FSDP2 inside each
    (ZeRO-3 over the replica, not over the whole data-parallel group), bf16, recompute.
    Each fits the 80 GB GPUs (the memory the model counts is below the planner's share
    of it) and every time is finite; unsharded, the same 14B/32B replicas do not fit."""
    import math

    from libra.train.config import TrainConfig

    examples = sorted(ROOT.glob("examples/*-gpu*.toml"))
    assert len(examples) == 6
    for path in examples:
        cfg = load_config(path)
        doc = describe(cfg)
        view = doc["replanner"]
        r = cfg.trainer.elastic.replica_ranks
        assert r > 1 and view["replica_ranks"] == r and "FSDP2" in view["sharding"]
        for o in view["options"]:
            t = o["train"]
            assert math.isfinite(o["t_iter_s"]) and math.isfinite(o["t_train_s"]), path
            assert (t["zero"], t["shard"], t["recompute"]) == (3, r, True)
            assert t["dp"] == r * (cfg.fleet.core_train + o["hybrids_training"])
            assert t["memory_gib"] < 80 * 0.9
        text = render(doc)
        assert f"replicas of {r} ranks each, FSDP2 (ZeRO-3) inside each replica" in text
        assert "does not fit" not in text
        one_rank = TrainConfig.model_validate(
            cfg.model_dump()
            | {"trainer": cfg.trainer.model_dump() | {"elastic": {}}}
            | {"fleet": cfg.fleet.model_dump() | {"hybrids": 0}}
        )
        unsharded = describe(one_rank)["replanner"]["options"][0]
        assert math.isinf(unsharded["t_train_s"]) and unsharded["train"]["memory_gib"] > 80


def test_a_hybrid_holds_the_same_gpus_in_both_roles() -> None:
    import pytest

    from libra.train.config import TrainConfig

    cfg = load_config(ROOT / "examples/search-r1-gpu48.toml").model_dump()
    cfg["trainer"]["elastic"]["replica_ranks"] = 4  # the hybrids' bucket is TP 8
    with pytest.raises(ValueError, match="first bucket's tp \\(8\\) must be 4"):
        TrainConfig.model_validate(cfg)


def test_what_stops_a_run_at_its_start_is_shown_before_it_starts(tmp_path) -> None:
    """The env, the task files and the hardware profile a config names are loaded as the
    run loads them: a dry run passed a missing tasks file, an unknown env or hardware
    profile, which the run then stopped on in its first seconds."""
    ok = describe(load_config(ROOT / "examples/cpu-train.toml"))
    assert ok["problems"] == [] and "a run stops here" not in render(ok)
    cases = {
        "data.train": (str(tmp_path / "missing.jsonl"), "data.train: tasks file "),
        "data.env": ("no-such-env", "data.env: unknown env 'no-such-env'"),
        "planner.hardware": ("h999", "planner.hardware: unknown hardware 'h999'"),
        "data.val": ("examples/data/arith-train.jsonl", "data.val: examples/data/arith-train"),
    }
    for key, (value, why) in cases.items():
        doc = describe(load_config(ROOT / "examples/cpu-train.toml", {key: value}))
        (problem,) = doc["problems"]
        assert problem.startswith(why), (key, problem)
        assert f"a run stops here: {problem}" in render(doc).splitlines()
