"""`libra rollout --num-tasks`: a count below 1 is one line naming the flag, before
anything starts (it used to run every task); in a config file `num_tasks` is checked the
same way, and left out means all tasks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from libra import config as cfgmod
from libra.errors import ConfigError
from libra.rollout.config import RolloutConfig
from tests.conftest import ROOT


@pytest.mark.parametrize("n", ["0", "-3"])
def test_num_tasks_below_one_is_one_line(n: str, tmp_path: Path) -> None:
    # the endpoint is a closed port: a run that got past the flag would fail differently
    r = subprocess.run(
        [sys.executable, "-m", "libra", "rollout", "--num-tasks", n, "--quiet",
         "--endpoint", "tp1=http://127.0.0.1:9", "--out", str(tmp_path / "r.jsonl")],
        capture_output=True, text=True, cwd=ROOT, timeout=120, check=False,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"libra: error: --num-tasks {n}: give the number of tasks to run (1 or more), "
        "or leave it out to run every task"
    ]
    assert not (tmp_path / "r.jsonl").exists()


def test_num_tasks_in_a_config(tmp_path: Path) -> None:
    assert RolloutConfig().num_tasks is None  # all tasks
    bad = tmp_path / "r.toml"
    bad.write_text("num_tasks = 0\n")
    with pytest.raises(ConfigError, match="num_tasks: Input should be greater than or equal to 1"):
        cfgmod.load(RolloutConfig, bad)


@pytest.mark.parametrize(
    ("spec", "why"),
    [("0:100", "tp: Input should be greater than or equal to 1 (got 0)"),
     ("2:-5", "bound: Input should be greater than or equal to 1 (got -5)")],
)  # fmt: skip
def test_a_bad_bucket_flag_is_one_line_naming_the_field(spec: str, why: str) -> None:
    """`--bucket tp1=0:100` was pydantic's four-line report, with its URL."""
    from libra.rollout.serving import merge_bucket_flags

    with pytest.raises(ConfigError) as err:
        merge_bucket_flags([], [], [("tp1", spec)])
    assert str(err.value) == f"bucket 'tp1': {why}"
