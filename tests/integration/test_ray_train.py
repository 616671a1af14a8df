"""`libra train` with its engines placed by Ray (`[cluster] backend = "ray"`) on a local
three-node Ray cluster (tests/conftest.py `ray_cluster`): the real embedded engines in
Ray actors on two nodes, the real trainer on this machine, the real `arith` env. The
checks read what a user reads: the steps and their reward, where each worker ran in
`events.jsonl`, and that no engine is left running once the command has exited."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.conftest import ROOT

CONFIG = f"""
out = "{{out}}"
seed = 5
steps = 3

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

[rollout]
group_size = 4
batch_groups = 2
concurrency = 16

[rollout.sampling]
max_tokens = 40

[sft]
steps = 0

[fleet]
core_rollout = 2
hybrids = 0

[planner]
adapt = false

[report]
display = "lines"
plots = false

[cluster]
backend = "ray"
address = "{{address}}"
"""


def rows(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines() if x.strip()]


def engines_of(out: Path) -> list[int]:
    """Live `libra serve-engine` processes serving this run's model (any node: the
    cluster's nodes share this machine)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if "serve-engine" in cmd and str(out) in cmd and state != "Z":
            found.append(int(d))
    return found


@pytest.mark.timeout(600)
def test_train_with_engines_placed_by_ray_on_two_nodes(tmp_path: Path, ray_cluster: Any) -> None:
    out = tmp_path / "run"
    config = tmp_path / "train.toml"
    config.write_text(CONFIG.replace("{out}", str(out)).replace("{address}", ray_cluster.address))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    t0 = time.monotonic()
    log = tmp_path / "train.log"
    seen: set[int] = set()  # engine processes seen while it ran
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "libra", "train", str(config)],
                                stdout=f, stderr=subprocess.STDOUT, env=env)  # fmt: skip
        try:
            while proc.poll() is None and time.monotonic() - t0 < 540:
                seen.update(engines_of(out))
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.kill()
            code = proc.wait()
    assert code == 0, log.read_text()[-4000:]
    assert len(seen) >= 2, seen
    print(f"libra train on Ray: {time.monotonic() - t0:.1f} s")

    # the steps ran and recorded a reward, as in a run on one machine
    metrics = rows(out / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert all(isinstance(r["reward"], float) for r in metrics)

    # events.jsonl names each worker's node: the engines on the two nodes with a CPU
    # (the head has none), the trainer on this machine's node
    workers = {n.node_id for n in ray_cluster.worker_nodes}
    head = ray_cluster.head_node.node_id
    started = [e for e in rows(out / "events.jsonl") if e["event"] == "fleet-started"]
    assert len(started) == 1
    nodes = started[0]["nodes"]
    assert {nodes["rollout0"], nodes["rollout1"]} == workers, nodes
    assert nodes["train0"] == head
    assert started[0]["roles"]["rollout"] == ["rollout0", "rollout1"]

    # nothing of the engines is left once the command has exited
    deadline = time.monotonic() + 15
    while engines_of(out) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not engines_of(out), f"engines left running: {engines_of(out)}"


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def wait_gone(pid: int, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return gone(pid)


@pytest.mark.timeout(300)
async def test_an_engine_on_ray_stops_with_its_actor(
    tmp_path: Path, ray_cluster: Any, tiny_model: Path
) -> None:
    """The launcher on its own: two engines on the two nodes; `stop_engine` ends one
    (its process group, from inside its actor); the other dies with its actor when the
    actor is killed outright, and then reads as lost."""
    import ray

    from libra.cluster.config import ClusterSection
    from libra.cluster.engines import EmbeddedLauncher, stop_engine
    from libra.cluster.placement import Slot
    from libra.cluster.process import healthy
    from libra.cluster.raylaunch import LOST, RayLauncher, RayProcess, connect

    connect(ClusterSection(backend="ray", address=ray_cluster.address))
    try:
        launcher = RayLauncher(EmbeddedLauncher(), ClusterSection(backend="ray"))
        here = Slot("local", "cpu")
        a, b = [await launcher.start(w, 1, here, str(tiny_model), tmp_path / "logs")
                for w in ("a", "b")]  # fmt: skip
        assert {a.slot.node, b.slot.node} == {n.node_id for n in ray_cluster.worker_nodes}
        assert isinstance(a.process, RayProcess) and isinstance(b.process, RayProcess)
        assert healthy(a.url) and healthy(b.url)
        assert a.process.returncode is None

        await stop_engine(a, 5.0)
        assert wait_gone(a.process.pid)

        ray.kill(b.process.actor)  # as when Ray kills a worker: no stop, no cleanup
        assert wait_gone(b.process.pid), "the engine outlived its actor"
        deadline = time.monotonic() + 15
        while b.process.returncode is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert b.process.returncode == LOST
        assert "gone" in b.process.last_error()
        await stop_engine(b, 1.0)  # stopping a lost engine is quiet
    finally:
        ray.shutdown()
