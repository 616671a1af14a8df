"""`libra train` with its engines placed by Ray (`[cluster] backend = "ray"`) on a local
three-node Ray cluster (tests/conftest.py `ray_cluster`): the real embedded engines in
Ray actors on two nodes, the real trainer on this machine, the real `arith` env. The
checks read what a user reads: the steps and their reward, where each worker ran in
`events.jsonl`, every episode recorded once when a node is lost mid-run, and that
nothing of the lost node, and no engine at all once the command has exited, is left
running."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.conftest import RAY_STORE, ROOT
from tests.integration.procs import descendants, engine_on, parent_of, wait_gone

CONFIG = f"""
out = "{{out}}"
seed = 5
steps = 10

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
def test_train_on_ray_places_engines_by_node_and_goes_on_when_a_node_is_lost(
    tmp_path: Path, ray_cluster: Any
) -> None:
    """Three CPU nodes, two engines: once the first episode is recorded (the rest of
    the first batch in flight, the whole run ahead) the node of `rollout0` is killed
    outright (its raylet and everything Ray started there, no cleanup). Its
    episodes re-route to the other engine, the engine is replaced on the spare node,
    every step trains, every episode is recorded once, and nothing of the killed node
    keeps running."""
    spare = ray_cluster.add_node(num_cpus=1, object_store_memory=RAY_STORE)
    ray_cluster.wait_for_nodes()
    out = tmp_path / "run"
    config = tmp_path / "train.toml"
    config.write_text(CONFIG.replace("{out}", str(out)).replace("{address}", ray_cluster.address))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    t0 = time.monotonic()
    log = tmp_path / "train.log"
    seen: set[int] = set()  # engine processes seen while it ran
    killed: dict[str, Any] = {}
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "libra", "train", str(config)],
                                stdout=f, stderr=subprocess.STDOUT, env=env)  # fmt: skip
        try:
            while proc.poll() is None and time.monotonic() - t0 < 540:
                seen.update(engines_of(out))
                # the first episode recorded: both engines serve, the others are in flight
                if (
                    not killed
                    and (out / "trajectories.jsonl").is_file()
                    and rows(out / "trajectories.jsonl")
                ):
                    killed = kill_node_of(ray_cluster, out, "rollout0")
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.kill()
            code = proc.wait()
            if not killed:  # leave the shared cluster as it was: two CPU nodes
                ray_cluster.remove_node(spare)
    assert code == 0, log.read_text()[-4000:]
    assert killed, "the run ended before its first episode was recorded"
    assert len(seen) >= 2, seen
    print(f"libra train on Ray, a node lost: {time.monotonic() - t0:.1f} s")

    # nothing of the killed node runs on: its engine (started in its own process group
    # by the actor) and the actor's worker process
    assert wait_gone(killed["engine"]), "the lost node's engine kept serving"
    left = [pid for pid in killed["workers"] if not wait_gone(pid)]
    assert not left, f"processes of the lost node left running: {left}"

    # every step trained and recorded a reward, as in a run on one machine
    metrics = rows(out / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, 11))
    assert all(isinstance(r["reward"], float) for r in metrics)

    # every episode once: the lost engine's turns re-routed, none recorded twice (the
    # run samples more groups than it trains on: groups of equal rewards are dropped)
    records = rows(out / "trajectories.jsonl")
    assert len(records) >= 10 * 2 * 4  # steps x groups x group size
    assert len({r["id"] for r in records}) == len(records)

    # events.jsonl names each worker's node: the engines on two of the nodes with a CPU
    # (the head has none), the trainer on this machine's node; the lost engine on the
    # killed node, its replacement on the one left free
    head = ray_cluster.head_node.node_id
    events = rows(out / "events.jsonl")
    started = [e for e in events if e["event"] == "fleet-started"]
    assert len(started) == 1
    nodes = started[0]["nodes"]
    cpu_nodes = {n.node_id for n in ray_cluster.worker_nodes} | {killed["node"]}
    assert nodes["rollout0"] != nodes["rollout1"], nodes
    assert {nodes["rollout0"], nodes["rollout1"]} <= cpu_nodes, nodes
    assert nodes["train0"] == head
    assert started[0]["roles"]["rollout"] == ["rollout0", "rollout1"]
    lost = [e for e in events if e["event"] == "engine-lost"]
    restarted = [e for e in events if e["event"] == "engine-restarted"]
    assert [(e["worker"], e["node"]) for e in lost] == [("rollout0", killed["node"])], lost
    # found by the watcher (the node does not answer) or by a publication it missed
    assert any(w in lost[0]["why"] for w in ("lost", "not delivered")), lost
    free = cpu_nodes - {killed["node"], nodes["rollout1"]}
    assert [(e["worker"], e["node"]) for e in restarted] == [("rollout0", *free)], restarted
    # no episode failed for it, and the replacement served turns of later steps
    assert not [r["error"] for r in records if r["status"] == "error"]
    served = {t["endpoint"] for r in records for t in r["turns"]}
    assert {lost[0]["url"], restarted[0]["url"]} <= served, served

    # nothing of the engines is left once the command has exited
    deadline = time.monotonic() + 15
    while engines_of(out) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not engines_of(out), f"engines left running: {engines_of(out)}"


def kill_node_of(cluster: Any, out: Path, worker: str) -> dict[str, Any]:
    """Kill the Ray node that runs `worker`'s engine, as a machine is lost: its raylet
    and the processes Ray started there get SIGKILL, nothing is stopped cleanly."""
    started = next(e for e in rows(out / "events.jsonl") if e["event"] == "fleet-started")
    node_id = started["nodes"][worker]
    node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
    served = (out / "logs" / f"engine-{worker}.log").read_text()
    port = int(re.findall(r"on http://[^:]+:(\d+)", served)[0])
    engine = engine_on(port)
    assert engine is not None, f"no engine of {worker} on port {port}"
    actor = parent_of(engine)
    raylet = node.all_processes["raylet"][0].process.pid
    workers = descendants(raylet)  # Ray's worker processes there, the actor's included
    assert actor in workers and engine in workers, (actor, engine, workers)
    cluster.remove_node(node, allow_graceful=False)
    return {"node": node_id, "engine": engine, "actor": actor, "workers": workers}


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
        assert a.slot.node != b.slot.node
        assert {a.slot.node, b.slot.node} <= {n.node_id for n in ray_cluster.worker_nodes}
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
