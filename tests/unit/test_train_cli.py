"""`--set KEY=VALUE` (`libra train`, `libra rollout`, `libra serve-rollout`): any config
key from the command line, its value read as TOML; a dedicated flag left out does not
undo it; a bad pair or key is one line naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from libra.cli.common import set_pairs
from libra.errors import ConfigError
from libra.train import load_config
from tests.conftest import ROOT


def test_values_are_toml_or_plain_text() -> None:
    pairs = set_pairs(["planner.adapt=false", "rollout.group_size=4", 'fleet.hybrid_start="train"',
                       "out=runs/a b", "x=[1, 2]"])  # fmt: skip
    assert pairs == [("planner.adapt", False), ("rollout.group_size", 4),
                     ("fleet.hybrid_start", "train"), ("out", "runs/a b"), ("x", [1, 2])]  # fmt: skip
    cfg = load_config(ROOT / "examples/cpu-train.toml", dict(pairs[:3]))
    assert not cfg.planner.adapt and cfg.rollout.group_size == 4
    assert cfg.fleet.hybrid_start == "train"
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        set_pairs(["planner.adapt"])


def test_an_unknown_key_is_one_line() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "libra", "train", "examples/cpu-train.toml", "--dry-run",
         "--set", "planner.adaptx=false"],
        capture_output=True, text=True, cwd=ROOT, timeout=120, check=False,
    )  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "planner.adaptx: unknown key" in r.stderr


def _train(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "libra", "train", "examples/cpu-train.toml", "--dry-run", "--json",
         *flags],
        capture_output=True, text=True, cwd=ROOT, timeout=120, check=False,
    )  # fmt: skip


def test_a_set_key_that_has_its_own_flag_is_not_undone_by_the_flag_left_out() -> None:
    # `--set steps=7` was dropped when `--steps` was not given (the unset flag's None
    # replaced it): the run trained the config's 30 steps, as the README says it would not
    assert json.loads(_train("--set", "steps=7").stdout)["steps"] == 7
    assert json.loads(_train("--set", "out=runs/elsewhere").stdout)["out"] == "runs/elsewhere"
    assert (
        json.loads(_train("--steps", "5", "--set", "steps=7").stdout)["steps"] == 5
    )  # the flag wins


def test_rollout_and_serve_rollout_take_set_too(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LIBRA_VLLM_PYTHON"}
    for cmd in (["rollout", "--out", str(tmp_path / "o.jsonl")],
                ["serve-rollout", "--port", "0", "--spool", str(tmp_path / "spool")]):  # fmt: skip
        r = subprocess.run(
            [sys.executable, "-m", "libra", *cmd, "--bucket", "tp2=2:4096", "--launch", "1",
             "--set", 'launch.kind="vllm"', "--set", "launch.vllm.gpus=[0]"],
            capture_output=True, text=True, cwd=ROOT, env=env, timeout=120, check=False,
        )  # fmt: skip
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "launch.vllm.gpus: the launched vLLM servers need 2 GPU(s)" in r.stderr
        assert "1 listed" in r.stderr
