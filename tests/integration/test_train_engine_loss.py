"""`libra train` goes on when a rollout engine dies: the engine is replaced on its
worker's devices at the current version (`Fleet.watch`, or `Fleet.replace_lost` when a
publication finds it dead first), no episode is lost or duplicated, and the run
completes (real embedded engines, the real trainer)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

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
max_tokens = 40

[sft]
steps = 0

[fleet]
core_rollout = 2
hybrids = 0

[report]
display = "lines"
plots = false
"""


def rows(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines() if x.strip()]


def engine_pids(out: Path) -> list[int]:
    """`libra serve-engine` processes serving this run's model."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "serve-engine" in cmd and str(out) in cmd:
                pids.append(int(d))
    return pids


@pytest.mark.timeout(600)
def test_a_killed_engine_is_replaced_and_the_run_completes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = tmp_path / "train.toml"
    config.write_text(CONFIG.format(out=out))
    log = tmp_path / "train.log"
    with log.open("wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "libra", "train", str(config)],
                                cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not ((out / "metrics.jsonl").is_file() and rows(out / "metrics.jsonl")):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no step within 300 s"
            time.sleep(0.2)
        pids = engine_pids(out)
        assert len(pids) == 2, pids
        os.kill(pids[0], signal.SIGKILL)
        assert proc.wait(timeout=420) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    events = rows(out / "events.jsonl")
    lost = [e for e in events if e["event"] == "engine-lost"]
    restarted = [e for e in events if e["event"] == "engine-restarted"]
    # found by the watcher (the process exited) or by a publication it missed
    assert len(lost) == 1, events
    assert any(w in lost[0]["why"] for w in ("exited with code -9", "not delivered")), lost
    assert [e["worker"] for e in restarted] == [lost[0]["worker"]]
    assert lost[0]["node"] == restarted[0]["node"] == "local"
    assert [r["step"] for r in rows(out / "metrics.jsonl")] == [1, 2, 3, 4]
    records = rows(out / "trajectories.jsonl")
    assert len({r["id"] for r in records}) == len(records)  # none twice
    assert not engine_pids(out), "an engine outlived the run"
