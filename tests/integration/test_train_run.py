"""A `libra train` run built as an object (`libra.train.build`) on loopback: a real
embedded engine, the real trainer, the real `arith` env. A run cancelled while
episodes are in flight (a second Ctrl-C, or an error elsewhere) still hands every
episode it started to the routing policy and the trajectory file: the cut ones as
`aborted` records."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from libra.train import load_config, placement
from libra.train.build import build_run
from libra.train.display import Display, View
from libra.train.loop import Telemetry
from libra.train.report import Report
from libra.train.state import prepare_out
from tests.conftest import ROOT
from tests.integration.train_util import TINY_MODEL

CONFIG = f"""
out = "{{out}}"
seed = 5
steps = 4

{TINY_MODEL}
[data]
env = "arith"
train = "{ROOT}/examples/data/arith-train.jsonl"

[rollout]
group_size = 4
batch_groups = 4
concurrency = 16

[rollout.sampling]
max_tokens = 200   # an untrained model rambles: episodes stay in flight for a while

[sft]
steps = 0

[fleet]
hybrids = 0

[report]
display = "off"
plots = false
"""


@pytest.mark.timeout(300)
async def test_a_cancelled_run_records_its_aborted_episodes(tmp_path: Path) -> None:
    path = tmp_path / "train.toml"
    path.write_text(CONFIG.format(out=tmp_path / "run"))
    cfg = load_config(path)
    out, saved = prepare_out(cfg, fresh=True)
    view = View(steps=cfg.steps)
    report = Report(out)
    telemetry = Telemetry(report, Display("off"), view)
    run = await build_run(cfg, out, saved, placement.launcher(cfg), telemetry, lambda: False)
    policy = run.checkpointer.policy
    learned: list[str] = []
    on_finish = policy.on_finish

    def spy(record: Any) -> None:  # the real policy still learns; we only watch
        learned.append(record.id)
        on_finish(record)

    policy.on_finish = spy  # type: ignore[method-assign]
    try:
        training = asyncio.create_task(run.train())
        deadline = time.monotonic() + 120
        while view.in_flight < 8:
            assert not training.done(), training
            assert time.monotonic() < deadline, "episodes never got in flight"
            await asyncio.sleep(0.05)
        training.cancel()
        with pytest.raises(asyncio.CancelledError):
            await training
        assert view.in_flight == 0  # every episode task ended with the run
    finally:
        await run.close()
        report.close()

    records = [orjson.loads(x) for x in (out / "trajectories.jsonl").read_bytes().splitlines()]
    aborted = [r for r in records if r["status"] == "aborted"]
    assert aborted, "the episodes in flight at the cancel left no record"
    assert all(r["error"] == "cancelled" and r["env"] == "arith" for r in aborted)
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids))  # one record per episode
    assert sorted(learned) == sorted(ids)  # the routing policy saw every one of them
