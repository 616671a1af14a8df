"""`libra train --set KEY=VALUE`: any config key from the command line, its value read
as TOML; a bad pair or key is one line naming it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from libra.cli.train import _settings
from libra.errors import ConfigError
from libra.train import load_config
from tests.conftest import ROOT


def test_values_are_toml_or_plain_text() -> None:
    pairs = _settings(["planner.adapt=false", "rollout.group_size=4", 'fleet.hybrid_start="train"',
                       "out=runs/a b", "x=[1, 2]"])  # fmt: skip
    assert pairs == [("planner.adapt", False), ("rollout.group_size", 4),
                     ("fleet.hybrid_start", "train"), ("out", "runs/a b"), ("x", [1, 2])]  # fmt: skip
    cfg = load_config(ROOT / "examples/cpu-train.toml", dict(pairs[:3]))
    assert not cfg.planner.adapt and cfg.rollout.group_size == 4
    assert cfg.fleet.hybrid_start == "train"
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        _settings(["planner.adapt"])


def test_an_unknown_key_is_one_line() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "libra", "train", "examples/cpu-train.toml", "--dry-run",
         "--set", "planner.adaptx=false"],
        capture_output=True, text=True, cwd=ROOT, timeout=120, check=False,
    )  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "planner.adaptx: unknown key" in r.stderr
