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
    assert {b["name"]: b["core"] + b["hybrids"] for b in lay["buckets"]} == serving == {"tp1": 46}
    assert lay["training_replicas"] == sum(w.role == "train" for w in workers) == 2
    assert lay["rollout_devices"] == sum(pl.instances(cfg)) == 46
    assert lay["problem"].startswith("fleet.vllm.gpus: list the GPU ids")  # none configured
    assert doc["plan"]["applied"] is False

    text = render(doc).splitlines()
    cut = next(i for i, line in enumerate(text) if "planner's split" in line)
    layout, plan = text[:cut], text[cut:]
    assert "advice, not applied: a run keeps the layout above" in plan[0]
    assert "  rollout, bucket tp1: 46 x TP1 vLLM instances (8 core + 38 hybrid)" in layout
    assert any(line.startswith("  a run stops here: fleet.vllm.gpus") for line in layout)
    # the planner's TP mix (2 x TP2, 1 x TP4, 3 x TP8 here) appears only under its label
    assert not any(f"TP{tp}" in line for line in layout for tp in (2, 4, 8))
    assert any("TP8" in line for line in plan)


def test_a_runnable_gpu_config_has_no_problem_and_an_embedded_one_no_plan() -> None:
    doc = describe(load_config(ROOT / "examples/search-r1-gpu8.toml"))
    assert doc["layout"]["problem"] is None
    assert "a run stops here" not in render(doc)
    cpu = describe(load_config(ROOT / "examples/cpu-train.toml"))
    assert "plan" not in cpu and cpu["layout"]["engine"] == "embedded"
    assert "  rollout, bucket tp1: 2 embedded engines (1 core + 1 hybrid)" in render(cpu)
