"""`libra train` end to end on loopback: real embedded engines, the real elastic trainer,
the real `arith` env and tools; a small config so it takes about two minutes.

One run is interrupted with Ctrl-C (SIGINT) after its first step and then resumed to the
end by the same command, as a user would (the resumed half with its episodes in two
rollout workers, one of them SIGKILLed); the checks read what the run leaves behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from libra.errors import ConfigError
from libra.train import load_config
from tests.conftest import ROOT
from tests.integration.procs import alive, descendants
from tests.integration.train_util import TINY_MODEL

CONFIG = f"""
out = "{{out}}"
seed = 3
steps = 16

{TINY_MODEL}
[data]
env = "arith"
train = "{ROOT}/examples/data/arith-train.jsonl"
val = "{ROOT}/examples/data/arith-val.jsonl"

[rollout]
group_size = 4
batch_groups = 4   # enough training per step that a second replica pays for its start
max_staleness = 1
concurrency = 32

[rollout.sampling]
max_tokens = 40

[rollout.dynamic_sampling]
max_replacements = 2

[sft]
steps = 20
demos = 48
target = 0.9

[validation]
every = 2
tasks = 8

[fleet]
hybrid_start = "rollout"

[planner.replan]
every_steps = 1
cooldown_steps = 0
gain_cost_ratio = 1.0

[report]
display = "lines"
checkpoint_every = 1
"""


def rows(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines() if x.strip()]


def rollout_workers(pid: int) -> list[int]:
    """The `libra.rollout.worker` processes below `pid`."""
    out = []
    for p in descendants(pid):
        try:
            if b"libra.rollout.worker" in Path(f"/proc/{p}/cmdline").read_bytes():
                out.append(p)
        except OSError:
            pass
    return out


def libra_train(config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "libra", "train", str(config), *extra]


@pytest.mark.timeout(900)
def test_train_interrupt_resume_and_report(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = tmp_path / "train.toml"
    config.write_text(CONFIG.replace("{out}", str(out)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    # 1. start, Ctrl-C after the first step: a checkpoint, exit 130, no process left
    log1 = tmp_path / "first.log"
    with open(log1, "wb") as f:
        proc = subprocess.Popen(libra_train(config), stdout=f, stderr=subprocess.STDOUT, env=env)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 600
        while not ((out / "metrics.jsonl").is_file() and rows(out / "metrics.jsonl")):
            assert proc.poll() is None, log1.read_text()
            assert time.monotonic() < deadline, "no step within 600 s"
            seen |= descendants(proc.pid)
            time.sleep(0.5)
        seen |= descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log1.read_text()
    assert code == 130, text
    assert "interrupted" in text
    assert len(seen) >= 3  # two engines and a trainer process at least
    deadline = time.monotonic() + 10
    while alive(seen) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(seen), f"left running after Ctrl-C: {alive(seen)}"
    state = orjson.loads((out / "state.json").read_bytes())
    stopped_at = state["version"]
    assert stopped_at >= 1
    assert (out / "checkpoint" / "trainer_state.json").is_file()  # sharded trainer state
    assert (out / "model" / "config.json").is_file()  # the weights at Ctrl-C, to serve

    # 2. the same command resumes from the checkpoint and finishes, here with its episodes
    # in two rollout workers (`rollout.workers` may change on resume), one of which is
    # SIGKILLed at the first step after the resume: it is replaced, the run goes on
    log2 = tmp_path / "second.log"
    with open(log2, "wb") as f:
        proc = subprocess.Popen(libra_train(config, "--set", "rollout.workers=2"), stdout=f,
                                stderr=subprocess.STDOUT, env=env)  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while len(rows(out / "metrics.jsonl")) <= stopped_at:
            assert proc.poll() is None, log2.read_text()
            assert time.monotonic() < deadline, "no step within 600 s"
            time.sleep(0.2)
        workers = rollout_workers(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[0], signal.SIGKILL)
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log2.read_text()
    assert code == 0, text
    assert f"resuming run in {out} at step {stopped_at}" in text
    assert re.search(rf"rollout worker \d \(pid {workers[0]}\) exited with -9", text), text
    assert len(re.findall(r"rollout worker \d started", text)) == 3  # two, one replacement
    # every engine, the resumed run's included, started on this run's model (the weights
    # the resumed one then gets by broadcast are the checkpoint's), never on another
    served = [m for f in (out / "logs").glob("engine-*.log")
              for m in re.findall(r"serving (\S+) on", f.read_text())]  # fmt: skip
    assert served and all(s.startswith(str(out)) for s in served), served

    metrics = rows(out / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, 17))
    for r in metrics:
        assert {"step", "reward", "val_reward", "tokens_per_s", "roles"} <= r.keys()
        assert r["staleness_max"] <= 1  # bounded staleness, enforced at admission
        assert r["stale_dropped"] == 0  # ... so the trainer never had to drop a record
        assert r["groups"] == 4
    assert any(r["val_reward"] is not None for r in metrics)

    # every turn records the weights version that produced it, also from a worker (the
    # workers follow the fleet's publications): that of its group or the next
    # (max_staleness 1); versions advance; each episode of the resumed run is recorded
    # once, a lost worker's re-runs included
    trajectories = rows(out / "trajectories.jsonl")
    versions = {t["policy_version"] for rec in trajectories for t in rec["turns"]}
    assert versions >= {0, 1, 2, 3}
    for rec in trajectories:
        assert rec["batch_id"] == f"v{rec['step']}"
        assert all(rec["step"] <= t["policy_version"] <= rec["step"] + 1 for t in rec["turns"])
    ids = [rec["id"] for rec in trajectories if rec["step"] > stopped_at]  # resumed run's
    assert ids and len(ids) == len(set(ids))
    # the routing tree the run saved learned from every trained episode at least
    assert orjson.loads((out / "routing-tree.json").read_bytes())["episodes"] >= 16 * 4 * 4

    # the planner moved the hybrid: it starts serving rollouts, but training takes
    # several times the rollout here, and a second replica pays its measured cost back
    # The replanner considers a move on a settled step whose measurements trigger it
    # (imbalance), and logs each; how many there are depends on where Ctrl-C lands
    # (a decision needs two steps measured in the running assignment, and once the
    # hybrid trains nothing triggers), so only their content and effect are checked.
    decisions = rows(out / "decisions.jsonl")
    by_step = {r["step"]: r for r in metrics}
    moving = {"starting", "waiting", "joining", "leaving"}
    for d in decisions:
        assert {"predicted_gain_s", "reconfig_cost_s", "reason", "calibration"} <= d.keys()
        # judged on steps the running assignment measured itself, never in a transition
        assert d["current"]["measured_steps"] >= 2, d
        assert not moving & set(by_step[d["step"]]["replicas"].values()), d
    applied = [d for d in decisions if d["apply"]]
    assert applied, [d["reason"] for d in decisions]
    for d in applied:
        assert d["predicted_gain_s"] > d["reconfig_cost_s"] > 0
    events = rows(out / "events.jsonl")
    switches = [e for e in events if e["event"] == "switch-done"]
    assert switches and switches[0]["to"] == "train"
    assert any(r["roles"].get("train") == 2 for r in metrics)

    summary = orjson.loads((out / "summary.json").read_bytes())
    assert summary["outcome"] == "done" and summary["steps"] == 16
    for name in ("reward", "throughput", "roles"):
        assert (out / "plots" / f"{name}.png").stat().st_size > 1000

    # 3. the same command once more: the run is finished, nothing runs, exit 3
    again = subprocess.run(libra_train(config), capture_output=True, text=True, env=env,
                           timeout=120)  # fmt: skip
    assert again.returncode == 3, again.stdout + again.stderr
    assert again.stdout.startswith(f"nothing ran: {out} holds a run already trained to step 16")


def test_bad_config_fails_at_load_with_the_field_path(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[rollout]\ngroup_size = 1\n")
    with pytest.raises(ConfigError, match=r"rollout\.group_size"):
        load_config(bad)
    bad.write_text("[fleet]\nhybrdis = 1\n")
    r = subprocess.run(libra_train(bad), capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert "fleet.hybrdis" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*-gpu*.toml")), ids=str)
def test_gpu_examples_plan_with_dry_run(example: Path) -> None:
    """Each GPU example loads and the global planner splits its GPUs; running one on a
    machine without its vLLM interpreter fails in one line naming the field."""
    from libra.train.dryrun import describe

    doc = describe(load_config(example))
    plan = doc["plan"]
    assert plan["gpus"] == doc["fleet"]["devices"]
    m = plan["mapping"]
    assert m["training_gpus"] + m["rollout_gpus"] <= plan["gpus"]
    assert m["buckets"] and plan["t_iter_s"] > 0
    env = {k: v for k, v in os.environ.items() if k != "LIBRA_VLLM_PYTHON"}
    r = subprocess.run(libra_train(example), capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 2 and "fleet.vllm.python" in r.stderr and "Traceback" not in r.stderr
