"""`libra bench gpu-check` (what `scripts/gpu-check.sh` runs on a GPU) on the CPU at a
tiny shape: the same code path end to end — GRPO steps through `Replica`, packing and
chunked log-probs, a DCP checkpoint that loads back to the same state, and the CPU vs
device comparison (here CPU against CPU: identical)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile

from libra.bench import gpu_check
from tests.conftest import ROOT

TINY = ["--device", "cpu", "--steps", "2", "--tokens", "600", "--min-len", "16",
        "--max-len", "200", "--budget", "256", "--chunk", "32", "--vocab", "512",
        "--hidden", "64", "--intermediate", "128", "--layers", "2", "--heads", "4",
        "--kv-heads", "2", "--head-dim", "16"]  # fmt: skip


def test_gpu_check_runs_the_trainer_end_to_end_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    p = argparse.ArgumentParser()
    gpu_check.add_arguments(p)
    out = gpu_check.run(p.parse_args(TINY))
    # its models, checkpoints and logs are removed (torch may leave its own caches)
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith("libra-")] == []
    train = out["train"]
    assert train["packing"] and len(train["steps"]) == 2
    for s in train["steps"]:
        assert s["tokens"] >= 600 and s["tokens_per_s"] > 0
        assert s["mfu"] is None and s["peak_memory_gib"] is None  # CPU: not measured
    assert train["steps"][0]["loss_per_token"] != train["steps"][1]["loss_per_token"]
    assert train["dcp"]["state_hash_equal"] and train["dcp"]["bytes"] > 0
    cmp = out["cpu_vs_device"]
    assert cmp["loss_rel_diff"] == 0.0 and cmp["grad_rel_diff"] == 0.0
    # packed rows and padded ones: the same loss and gradient (what the GPU run checks
    # against the transformers installed there)
    assert cmp["packed_vs_padded_loss_rel_diff"] < 1e-5
    assert cmp["packed_vs_padded_grad_rel_diff"] < 1e-5
    phases = train["steps"][0]["phases_s"]
    assert set(phases) == {"compute_s", "exchange_s", "apply_s"} and phases["compute_s"] > 0
    assert out["failed"] == []
    # a hybrid joined the core replica, caught up and trained bit-identically
    el = out["elastic"]
    assert el["hash_checks"] > 0 and el["hash_mismatches"] == 0 and el["join_latency_s"] > 0


def test_the_script_asks_for_a_gpu_it_does_not_have():
    r = subprocess.run(
        [sys.executable, "-m", "libra", "bench", "gpu-check", "--device", "cuda"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode != 0 and "torch sees no CUDA device" in r.stderr


def test_a_part_that_fails_is_reported_and_the_others_still_run(monkeypatch):
    """One device session answers every part: a failing part's error is in the JSON,
    the rest still ran, and the command exits 1."""
    from libra.cli import bench

    def broken(args):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(gpu_check, "_elastic", broken)
    p = argparse.ArgumentParser()
    gpu_check.add_arguments(p)
    args = p.parse_args([*TINY, "--parts", "cpu_vs_device,elastic"])
    out = gpu_check.run(args)
    assert out["failed"] == ["elastic"] and "no such kernel" in out["elastic"]["error"][-1]
    assert out["cpu_vs_device"]["loss_rel_diff"] == 0.0 and "train" not in out
    args.json, args._bench = True, gpu_check
    assert bench.run(args) == 1


def test_profile_times_both_layouts_and_prints_where_a_step_goes(capsys):
    p = argparse.ArgumentParser()
    gpu_check.add_arguments(p)
    out = gpu_check.run(p.parse_args([*TINY, "--profile"]))
    assert len(out["packed"]["step_s"]) == 2 and len(out["padded"]["step_s"]) == 2
    assert out["tokens"] >= 600
    err = capsys.readouterr().err
    assert "Self CPU" in err and "aten::" in err  # the profiler's tables
