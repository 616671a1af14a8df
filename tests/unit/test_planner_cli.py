"""`libra plan` as a user runs it, the `local` calibration, and the planner benchmark."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest

from libra.cli import main
from libra.planner import calibrate_local, load_model, plan
from libra.planner.workload import WorkloadStats
from tests.unit.test_planner import agentic_records


@pytest.fixture()
def trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"\n".join(r.to_json() for r in agentic_records(128)) + b"\n")
    return path


def test_plan_a_trace_as_json(trace, capsys):
    assert main(["plan", "--gpus", "16", "--workload", str(trace), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["gpus"] == 16 and doc["mode"] == "async"
    assert doc["workload"]["episodes"] == 128
    assert doc["t_iter_s"] == max(doc["t_train_s"], doc["t_rollout_s"])
    assert doc["train_gpus"] + doc["rollout_gpus"] + doc["idle_gpus"] == 16
    for group in doc["rollout"]:
        assert {"tp", "instances", "min_tokens", "max_tokens", "t_s"} <= set(group)
    assert doc["search"]["solve_s"] > 0 and doc["search"]["train_evaluated"] > 0


def test_plan_prints_a_readable_report(trace, capsys):
    args = ["plan", "--gpus", "24", "--workload", str(trace), "--sync", "--model", "qwen3-4b"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "synchronous RL" in out and "t_iter" in out and "weight sync" in out
    assert "training:" in out and "rollout:" in out and "solve" in out


def test_batch_and_group_resample_a_trace(trace, capsys):
    argv = ["plan", "--gpus", "16", "--workload", str(trace), "--batch", "8", "--group", "4"]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["episodes"] == 32


def test_exhaustive_flag_matches_the_pruned_plan(trace, capsys):
    base = ["plan", "--gpus", "12", "--workload", str(trace), "--bins", "6", "--json"]
    main(base)
    pruned = json.loads(capsys.readouterr().out)
    main([*base, "--exhaustive"])
    full = json.loads(capsys.readouterr().out)
    assert pruned["t_iter_s"] == full["t_iter_s"] and full["search"]["exhaustive"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hardware", "b200"], "unknown hardware 'b200'; known: a800-80g"),
        (["--model", "gpt-5"], "unknown model 'gpt-5'; known:"),
        (["--workload", "no-such.jsonl"], "no such trace file"),
        (["--model", "qwen3-32b", "--hardware", "ascend-910b3", "--gpus", "4"], "needs at least"),
        (["--gpus", "0"], "argument --gpus: expected an integer >= 1, got 0"),
        (["--bins", "x"], "argument --bins: expected an integer >= 1, got 'x'"),
        (["--batch", "10000000"], "160,000,000 episodes a step; the planner models at most"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, trace, capsys):
    full = ["plan", "--workload", str(trace), *argv]
    if "--gpus" not in argv:
        full += ["--gpus", "8"]
    try:
        rc = main(full)
    except SystemExit as e:  # argparse's own checks (types)
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_named_workloads_come_from_the_generators(capsys):
    if importlib.util.find_spec("libra.sim.workloads") is None:
        pytest.skip("libra.sim.workloads (issue 5) is not in this checkout")
    assert main(["plan", "--gpus", "48", "--workload", "search-r1", "--batch", "8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["episodes"] == 8 * 16
    assert main(["plan", "--gpus", "8", "--workload", "nope"]) == 2
    assert "unknown workload 'nope'" in capsys.readouterr().err


def test_local_profile_is_measured_and_plans(tmp_path):
    hw = calibrate_local(devices=2, budget_s=0.05)
    assert hw.id == "local" and hw.devices_per_node == 2
    assert hw.flops > 1e8 and hw.hbm_bandwidth > 1e8 and hw.memory_bytes > 1e8
    assert 0 < hw.eff.train_mfu <= 1 and 0 < hw.eff.prefill_mfu <= 1
    # The tiny CPU model (make-model's default shape) plans on it.
    cfg = {
        "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 4096,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = load_model(str(tmp_path))
    stats = WorkloadStats.from_records(agentic_records(32)).resample(32)
    p = plan(model, hw, stats, 2)
    assert p.train_gpus == 1 and p.rollout_gpus == 1 and p.t_iter > 0


def test_benchmark_reports_its_goals():
    if importlib.util.find_spec("libra.sim.workloads") is None:
        pytest.skip("libra.sim.workloads (issue 5) is not in this checkout")
    from libra.bench import planner as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    doc = bench.run(p.parse_args(["--quick", "--repeats", "1"]))
    assert doc["exact"] is True
    for row in doc["pruned_vs_exhaustive"]:
        assert row["t_iter_pruned_s"] == row["t_iter_exhaustive_s"]
    assert {r["gpus"] for r in doc["solve_time"]} >= {48}


def test_public_surface_and_light_import():
    import subprocess
    import sys

    import libra.planner as planner

    assert all(hasattr(planner, name) for name in planner.__all__)
    code = "import sys, libra.planner, libra.cli.plan; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # torch only for calibrate_local, imported inside it


def test_a_large_generated_batch_plans_from_a_sample_of_it(capsys, monkeypatch):
    """A batch past `GENERATED` episodes is a generated sample resampled to its size: it
    plans the batch it was asked for, close to what the whole generated batch plans (the
    same layout; the iteration within the noise of another sample of prompts), without
    generating every episode (a million took minutes and gigabytes)."""
    from libra.cli import plan as plan_cli
    from libra.sim import workloads

    argv = ["plan", "--gpus", "48", "--workload", "search-r1", "--batch", "256", "--json"]
    assert main(argv) == 0
    whole = json.loads(capsys.readouterr().out)
    made: list[int] = []
    sample = workloads.sample

    def counted(name: str, prompts: int, group: int, **kw):  # type: ignore[no-untyped-def]
        made.append(prompts * group)
        return sample(name, prompts, group, **kw)

    monkeypatch.setattr(workloads, "sample", counted)
    monkeypatch.setattr(plan_cli, "GENERATED", 2048)
    assert main(argv) == 0
    sampled = json.loads(capsys.readouterr().out)
    assert made == [2048]
    assert sampled["workload"]["episodes"] == whole["workload"]["episodes"] == 256 * 16
    assert (sampled["train_gpus"], sampled["rollout_gpus"]) == (
        whole["train_gpus"],
        whole["rollout_gpus"],
    )
    assert sampled["t_iter_s"] == pytest.approx(whole["t_iter_s"], rel=0.05)
