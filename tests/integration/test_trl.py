"""TRL's GRPOTrainer trained on a real `libra serve-rollout` (issue 23, item 2):
examples/trl_grpo.py runs 3 GRPO steps whose completions are the service's records, whose
reward TRL logs is the env's, and whose weights reach the service's engine after each step
(the next step's turns carry the new policy version). The service maps TRL's row layout
onto the env's fields, and refuses a row it cannot map with the missing field."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from libra.client import Client, ServiceError
from tests.conftest import ROOT
from tests.integration.service_util import Service

pytest.importorskip("trl")

FLAGS = ("--env", "arith", "--env", "say-a=examples/stream_env.py:SayA", "--concurrency", "32",
         "--max-tokens", "32", "--max-turns", "4")  # fmt: skip
CONFIG = """
[[buckets]]
name = "tp1"
tp = 1
launch = 1
"""
STEP = re.compile(
    r"step (\d+): reward ([\d.]+) \(libra_reward mean ([\d.]+) over (\d+)/(\d+) episodes, "
    r"\d+ tool/template tokens masked\) from policy version\(s\) \[([\d, ]*)\]; "
    r"published version (\d+)"
)


def test_trl_grpo_trains_on_the_services_episodes(tmp_path: Path, tiny_model: Path) -> None:
    svc = Service(tmp_path, tiny_model, [], *FLAGS, config=CONFIG)
    svc.start(timeout=180)
    try:
        with Client(svc.url, reconnect_s=5) as c:
            with pytest.raises(ServiceError) as err:  # TRL layout without an answer column
                c.submit("arith", [{"prompt": [{"role": "user", "content": "What is 1+1?"}]}])
            assert err.value.status == 400 and "answer" in str(err.value), err.value
        run = subprocess.run(
            [sys.executable, "examples/trl_grpo.py", "--url", svc.url, "--model",
             str(tiny_model), "--steps", "3", "--prompts", "2", "--group-size", "4",
             "--out", str(tmp_path / "trl")],
            cwd=ROOT, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-4000:]
        steps = STEP.findall(run.stdout)
        assert [int(s[0]) for s in steps] == [1, 2, 3], run.stdout
        for step, trl_reward, libra_mean, ok, total, versions, published in steps:
            # TRL's logged reward is the env's, over every episode of the step.
            assert trl_reward == libra_mean and ok == total == "8"
            # Each step sampled from the weights TRL had after the step before.
            assert versions == str(int(step) - 1) and published == step
        # The service ran those episodes: one batch a step, 2 prompts x 4 samples each.
        batches = [d for d in svc.spool.iterdir() if (d / "records.jsonl").exists()]
        episodes = [ln for d in batches for ln in (d / "records.jsonl").read_text().splitlines()]
        assert len(batches) == 3 and len(episodes) == 24
    finally:
        svc.close()
