"""`libra train` stops, in one line, a run that cannot go on: an env whose reward
returns a dict without `reward` (every episode `error`; before, the run trained on
nothing to its last step and exited 0, its display saying only `reward 0.000`), and a
run folder that cannot take its writes. Real runs on loopback: embedded engine,
trainer, the `arith` env."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tests.conftest import ROOT
from tests.integration.train_util import TINY_MODEL

ENV = """
from libra.envs.arith import Arith


class NoRewardKey(Arith):
    async def reward(self, task, trajectory):
        return {"score": 1.0}  # a common mistake: the dict needs 'reward'
"""

CONFIG = f"""
out = "{{out}}"
seed = 1
steps = 20

{TINY_MODEL}
[data]
env = "{{env}}"
train = "{ROOT}/examples/data/arith-train.jsonl"

[rollout]
group_size = 4
batch_groups = 2
concurrency = 16

[rollout.sampling]
max_tokens = 16

[sft]
steps = 0

[fleet]
hybrids = 0

[report]
display = "lines"
plots = false
checkpoint_every = 2
"""


@pytest.mark.timeout(300)
def test_a_run_whose_episodes_all_fail_stops_naming_the_error(tmp_path: Path) -> None:
    env = tmp_path / "broken_env.py"
    env.write_text(ENV)
    cfg = tmp_path / "run.toml"
    cfg.write_text(CONFIG.format(out=tmp_path / "run", env=f"{env}:NoRewardKey"))
    done = subprocess.run([sys.executable, "-m", "libra", "train", str(cfg)], cwd=ROOT,
                          capture_output=True, text=True, timeout=280, check=False)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("libra: error: every episode of steps 1, 2, 3 ended error"), last
    assert "\"reward: the returned dict has no 'reward' key\"" in last
    assert "resumes from its checkpoint at step 2" in last
    assert "Traceback" not in done.stderr
    assert done.stderr.count("every episode ended error, nothing to learn from") == 3
    events = [
        orjson.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_bytes().splitlines()
    ]
    failed = [e for e in events if e["event"] == "all-episodes-failed"]
    assert [e["step"] for e in failed] == [1, 2, 3]
    assert all(e["episodes"] > 0 and sum(e["errors"].values()) == e["episodes"] for e in failed)


@pytest.mark.timeout(300)
def test_a_run_whose_disk_fills_up_stops_in_one_line(tmp_path: Path) -> None:
    """Writes the run folder cannot take (here a file size limit on the process and its
    children, which fails writes as a full disk does) stop the run in one line naming
    the cause and the way on; before, a traceback ending in an `OSError` raised while
    closing the trajectory file, the first failure lost in its context."""
    import resource

    cfg = tmp_path / "run.toml"
    cfg.write_text(CONFIG.format(out=tmp_path / "run", env="arith"))

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (400_000, resource.RLIM_INFINITY))

    done = subprocess.run([sys.executable, "-m", "libra", "train", str(cfg)], cwd=ROOT,
                          capture_output=True, text=True, timeout=280, check=False,
                          preexec_fn=limited)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "libra: error: a file outgrew this process's file size limit (ulimit -f) (File too large"
    ), last
    assert f"Free space under {tmp_path / 'run'}" in last and "starts it again" in last
    assert "Traceback" not in done.stderr
