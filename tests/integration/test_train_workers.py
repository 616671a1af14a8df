"""`libra train` with its episodes in rollout workers (`rollout.workers = 2`, #22): real
embedded engines, the real trainer, the real `arith` env. A worker killed mid-run is
replaced; the run trains every step, each episode is recorded once, every turn carries
the weights version its engine served (the workers follow the fleet's publications),
and the routing tree the front learned from the workers' records is saved."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import orjson
import pytest

from tests.conftest import ROOT
from tests.integration.test_train import descendants, libra_train, rows

CONFIG = f"""
out = "{{out}}"
seed = 11
steps = 4

[model]
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 1
num_attention_heads = 2
num_key_value_heads = 2
max_position_embeddings = 1024

[data]
env = "arith"
train = "{ROOT}/examples/data/arith-train.jsonl"
val = "{ROOT}/examples/data/arith-val.jsonl"

[rollout]
group_size = 4
batch_groups = 4
concurrency = 16
workers = 2

[rollout.sampling]
max_tokens = 40

[sft]
steps = 0

[validation]
every = 2
tasks = 8

[report]
display = "lines"
plots = false
"""


def rollout_workers(pid: int) -> list[int]:
    out = []
    for p in descendants(pid):
        try:
            if b"libra.rollout.worker" in Path(f"/proc/{p}/cmdline").read_bytes():
                out.append(p)
        except OSError:
            pass
    return out


@pytest.mark.timeout(600)
def test_train_on_rollout_workers_survives_a_killed_worker(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = tmp_path / "train.toml"
    config.write_text(CONFIG.replace("{out}", str(out)))
    log = tmp_path / "train.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as f:
        proc = subprocess.Popen(libra_train(config), stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while not ((out / "metrics.jsonl").is_file() and rows(out / "metrics.jsonl")):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "no step within 300 s"
            time.sleep(0.2)
        workers = rollout_workers(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[0], signal.SIGKILL)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert code == 0, text
    assert re.search(r"rollout worker \d \(pid \d+\) exited with -9", text), text
    assert len(re.findall(r"rollout worker \d started", text)) == 3  # two, one replacement

    metrics = rows(out / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    assert all(r["groups"] == 4 and r["stale_dropped"] == 0 for r in metrics)
    trajectories = rows(out / "trajectories.jsonl")
    ids = [r["id"] for r in trajectories]
    assert len(ids) == len(set(ids))  # each episode recorded once, re-runs included
    for r in trajectories:
        assert r["batch_id"] == f"v{r['step']}"
        # a turn is served by weights at least as new as its group's, at most one newer
        assert all(r["step"] <= t["policy_version"] <= r["step"] + 1 for t in r["turns"]), r
    assert {t["policy_version"] for r in trajectories for t in r["turns"]} >= {0, 1, 2, 3}
    val = [e for e in rows(out / "events.jsonl") if e["event"] == "validation"]
    assert [e["version"] for e in val] == [0, 2, 4] and all(e["episodes"] == 8 for e in val)
    # the front's policy learned from the workers' records (all steps' trained ones at
    # least) and saved what it learned
    tree = orjson.loads((out / "routing-tree.json").read_bytes())
    assert tree["episodes"] >= 4 * 4 * 4
