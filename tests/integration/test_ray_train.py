"""`libra train` placed by Ray (`[cluster] backend = "ray"`) on a local Ray cluster
(tests/conftest.py `ray_cluster`, grown by the tests): the real embedded engines and the
real trainer's ranks in Ray actors, each on its own node, the real `arith` env. The
checks read what a user reads: the steps and their reward, where each worker ran in
`events.jsonl`, every episode recorded once when an engine's node is lost mid-run, the
run going on when a hybrid's node is lost and stopping in one line (then resuming) when
a core training replica's is, and that nothing of a lost node, and no engine or trainer
rank at all once the command has exited, is left running."""

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

from tests.conftest import RAY_STORE, ROOT, grow, shrink
from tests.integration.procs import descendants, engine_on, parent_of, wait_gone
from tests.integration.train_util import TINY_MODEL

CONFIG = f"""
out = "{{out}}"
seed = 5
steps = 10

{TINY_MODEL}
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
    return [pid for pid, cmd in _live() if "serve-engine" in cmd and str(out) in cmd]


def ranks_of(pids: list[int]) -> list[int]:
    """Those of `pids` that are live trainer ranks started on a node
    (`python -m libra.trainer.remote`)."""
    return [pid for pid, cmd in _live() if pid in pids and "libra.trainer.remote" in cmd]


def _live() -> list[tuple[int, str]]:
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append((int(d), cmd))
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
    grow(ray_cluster, 2)  # the trainer's node, and a spare
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
            shrink(ray_cluster)
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

    # events.jsonl names each worker's node: the engines and the trainer's replica each
    # on its own node with a CPU (the head has none); the lost engine on the killed
    # node, its replacement on the one left free
    events = rows(out / "events.jsonl")
    started = [e for e in events if e["event"] == "fleet-started"]
    assert len(started) == 1
    nodes = started[0]["nodes"]
    cpu_nodes = set(killed["cpu_nodes"])
    assert len({nodes["rollout0"], nodes["rollout1"], nodes["train0"]}) == 3, nodes
    assert {nodes["rollout0"], nodes["rollout1"], nodes["train0"]} <= cpu_nodes, nodes
    assert started[0]["roles"]["rollout"] == ["rollout0", "rollout1"]
    lost = [e for e in events if e["event"] == "engine-lost"]
    restarted = [e for e in events if e["event"] == "engine-restarted"]
    assert [(e["worker"], e["node"]) for e in lost] == [("rollout0", killed["node"])], lost
    # found by the watcher (the node does not answer) or by a publication it missed
    assert any(w in lost[0]["why"] for w in ("lost", "not delivered")), lost
    free = cpu_nodes - {killed["node"], nodes["rollout1"], nodes["train0"]}
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


TRAINER_CONFIG = (
    CONFIG.replace("steps = 10", "steps = 8")
    .replace(
        "core_rollout = 2\nhybrids = 0", 'core_rollout = 1\nhybrids = 1\nhybrid_start = "train"'
    )
    # no staleness: once a step's row is written the trainer waits for the next batch
    .replace("concurrency = 16", "concurrency = 16\nmax_staleness = 0")
    .replace("plots = false", "plots = false\ncheckpoint_every = 100")
    # a member lost between its admission and its epoch holds the core this long
    + "\n[trainer.elastic]\ntimeout_s = 20\n"
)


@pytest.mark.timeout(600)
def test_train_on_ray_saves_a_lost_core_replicas_step_from_the_hybrid_and_drops_a_lost_hybrid(
    tmp_path: Path, ray_cluster: Any
) -> None:
    """One engine, the core training replica and a hybrid training replica, each on its
    own node. Once the hybrid has joined and trained a step, the core replica's node is
    killed outright between two steps: the command stops in one line naming the replica
    and its node, with the checkpoint of that step saved from the hybrid (no periodic
    one was due). The same command resumes there; after its first step the hybrid's
    node is killed outright, and the run goes on without it to the end. Nothing of
    either lost node is left running."""
    grow(ray_cluster, 2)  # engine, core, hybrid, and one spare
    out = tmp_path / "run"
    config = tmp_path / "train.toml"
    config.write_text(
        TRAINER_CONFIG.replace("{out}", str(out)).replace("{address}", ray_cluster.address)
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-m", "libra", "train", str(config)]
    killed: dict[str, dict[str, Any]] = {}
    runs: list[subprocess.Popen[bytes]] = []
    t0 = time.monotonic()
    try:
        first, done = run_until(cmd, env, tmp_path / "train.log", out, joined=True)
        runs.append(first)
        killed["train0"] = kill_trainer_node(ray_cluster, out, "train0")
        code = first.wait(timeout=300)
        text = (tmp_path / "train.log").read_text()
        # stopped in one line naming the core replica and its node, and how to go on
        assert code != 0, text[-3000:]
        lines = [x for x in text.splitlines() if x.startswith("libra: error:")]
        assert len(lines) == 1, text[-3000:]
        node = killed["train0"]["node"]
        assert "core replica core0" in lines[0] and node in lines[0], lines[0]
        saved = f"resumes from its checkpoint at step {done} (saved from hybrid0 after the loss)"
        assert saved in lines[0], lines[0]
        assert state_version(out) == done
        events = rows(out / "events.jsonl")
        started = next(e for e in events if e["event"] == "fleet-started")
        on = started["nodes"]
        assert len({on["rollout0"], on["train0"], on["hybrid0"]}) == 3, on
        head = ray_cluster.head_node.node_id
        assert head not in on.values(), on
        failed = [e for e in events if e["event"] == "trainer-failed"]
        assert len(failed) == 1 and node in failed[0]["why"], failed
        assert failed[0]["saved_from"] == "hybrid0", failed
        recorded = [r["id"] for r in rows(out / "trajectories.jsonl")]

        # the same command resumes at that step; its hybrid's node is lost after a step
        again, _ = run_until(cmd, env, tmp_path / "again.log", out, rows_past=done)
        runs.append(again)
        resumed = [e for e in rows(out / "events.jsonl")[len(events) :]
                   if e["event"] == "fleet-started"]  # fmt: skip
        assert resumed, (tmp_path / "again.log").read_text()[-3000:]
        killed["hybrid0"] = kill_trainer_node(ray_cluster, out, "hybrid0", resumed[-1])
        code = again.wait(timeout=300)
        text = (tmp_path / "again.log").read_text()
        assert code == 0, text[-3000:]
        assert f"resuming run in {out} at step {done}" in text
        metrics = rows(out / "metrics.jsonl")
        assert [r["step"] for r in metrics] == list(range(1, 9)), metrics
        assert all(isinstance(r["reward"], float) for r in metrics)
        later = rows(out / "events.jsonl")[len(events) :]
        # the hybrid's loss cost the run nothing: it went on to the end without it
        dropped = [e for e in later if e["event"] == "trainer-dropped"]
        assert [e["replica"] for e in dropped] == ["hybrid0"], dropped
        # the resumed engine got the checkpoint's weights: no publication failed
        assert not [e for e in later if e["event"] in ("weights-not-delivered", "engine-lost")]
        # nothing of the lost nodes is left: their ranks, Ray's workers there
        for k in killed.values():
            assert not [p for p in k["workers"] if not wait_gone(p)], k
        # every episode once in trajectories.jsonl; those the first run recorded after
        # its checkpoint (drawn again by the resumed run) set aside, not lost
        ids = [r["id"] for r in rows(out / "trajectories.jsonl")]
        assert len(ids) == len(set(ids))
        aside = out / "trajectories-superseded.jsonl"
        moved = [r["id"] for r in rows(aside)] if aside.is_file() else []
        assert set(recorded) <= set(ids) | set(moved)  # nothing the first run finished lost
        print(f"libra train on Ray, trainer nodes lost, resumed: {time.monotonic() - t0:.1f} s")
    finally:
        for proc in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shrink(ray_cluster)
    # no trainer rank of the run is left once the command has exited
    assert not ranks_of([pid for pid, _ in _live()]), "trainer ranks left running"


def run_until(
    cmd: list[str], env: dict[str, str], log: Path, out: Path, *, joined: bool = False,
    rows_past: int = 0,
) -> tuple[subprocess.Popen[bytes], int]:  # fmt: skip
    """Start `cmd` (output to `log`) and return once it has written a metrics row past
    `rows_past`, and with `joined`, one past the step in which a hybrid joined: (the
    process, the rows written). The process is killed if this fails."""
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 400
        joined_at = None if joined else rows_past
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            done = len(rows(out / "metrics.jsonl")) if (out / "metrics.jsonl").is_file() else 0
            if joined_at is None:
                events = rows(out / "events.jsonl") if (out / "events.jsonl").is_file() else []
                if any(e["event"] == "trainer-joined" for e in events):
                    joined_at = done
            if joined_at is not None and done > joined_at:
                return proc, done
            time.sleep(0.05)
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def state_version(out: Path) -> int:
    """The step of the run's last checkpoint (0: none yet)."""
    try:
        return int(orjson.loads((out / "state.json").read_bytes())["version"])
    except (OSError, ValueError, KeyError):
        return 0


def kill_trainer_node(
    cluster: Any, out: Path, worker: str, started: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Kill the Ray node that runs `worker`'s training replica, as a machine is lost
    (where `started`, a `fleet-started` event, placed it; default: the run's first)."""
    if started is None:
        started = next(e for e in rows(out / "events.jsonl") if e["event"] == "fleet-started")
    node_id = started["nodes"][worker]
    node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
    raylet = node.all_processes["raylet"][0].process.pid
    workers = descendants(raylet)
    assert ranks_of(workers), f"no trainer rank of {worker} on its node"
    cluster.remove_node(node, allow_graceful=False)
    return {"node": node_id, "workers": workers}


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
    cpu_nodes = [n.node_id for n in cluster.worker_nodes]
    cluster.remove_node(node, allow_graceful=False)
    return {"node": node_id, "engine": engine, "actor": actor, "workers": workers,
            "cpu_nodes": cpu_nodes}  # fmt: skip


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


@pytest.mark.timeout(120)
def test_a_group_goes_to_the_node_it_prefers_when_that_node_has_room(
    tmp_path: Path, ray_cluster: Any
) -> None:
    """The primitive under "a hybrid switches roles on its own node": a group of
    children (a training replica's ranks) asked for on a node with room lands there,
    on either node; asked for on a full node it lands on another; and the children run
    on their node with its address in their environment."""
    import ray

    from libra.cluster.config import ClusterSection
    from libra.cluster.raychildren import remove_group, start_group
    from libra.cluster.raylaunch import connect

    def settled() -> None:  # both nodes' CPUs free again (a removal takes a moment)
        deadline = time.monotonic() + 30
        while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)

    connect(ClusterSection(backend="ray", address=ray_cluster.address))
    try:
        a, b = [n.node_id for n in ray_cluster.worker_nodes]
        settled()
        for want in (b, a):  # a child that ended gives its node back before `join` returns
            group, [child] = start_group(
                "prefers", "this", [{}], [tmp_path / f"zen-{want[:6]}.log"], cpus=1.0,
                prefer=want, wait_s=30,
            )  # fmt: skip
            assert child.node == want
            child.join(10)  # `python -m this` prints and exits
            zen = (tmp_path / f"zen-{want[:6]}.log").read_text()
            assert "Beautiful is better than ugly" in zen
            remove_group(group)
        hold, [held] = start_group("hold", "http.server", [{}], [tmp_path / "hold.log"],
                                   cpus=1.0, prefer=a, wait_s=30)  # fmt: skip
        assert held.node == a
        group, [child] = start_group("elsewhere", "this", [{}], [tmp_path / "else.log"],
                                     cpus=1.0, prefer=a, wait_s=30)  # fmt: skip
        assert child.node == b  # a is full: the soft target gives way
        child.join(10)
        pid = held.pid
        held.kill()
        assert pid is not None and wait_gone(pid), "a killed child kept running"
        remove_group(group)
        remove_group(hold)
    finally:
        ray.shutdown()


@pytest.mark.timeout(180)
def test_a_cuda_trainers_ranks_each_get_a_gpu_of_their_node_from_ray(
    tmp_path: Path, ray_cluster: Any
) -> None:
    """A CUDA trainer on Ray (`trainer.device` resolved against the cluster's `GPU`
    resources): each rank's bundle asks for one GPU, so a replica lands on a node with
    GPUs and every rank sees one GPU of its own (Ray's CUDA_VISIBLE_DEVICES, what its
    `cuda(0)` then means). The GPUs here are Ray's logical ones: nothing computes on
    them (docs/cluster.md)."""
    import ray

    from libra.cluster.config import ClusterSection
    from libra.cluster.raychildren import remove_group, start_group
    from libra.cluster.raylaunch import connect
    from libra.train.rayranks import RayStarter

    (tmp_path / "showgpu.py").write_text(
        "import os\nprint('CVD=' + os.environ.get('CUDA_VISIBLE_DEVICES', 'unset'))\n"
    )
    section = ClusterSection(backend="ray", address=ray_cluster.address)
    connect(section)
    gpu_node = None
    try:
        assert not RayStarter(section, tmp_path).cuda_here()  # two CPU nodes: auto is CPU
        gpu_node = ray_cluster.add_node(num_cpus=2, num_gpus=2, object_store_memory=RAY_STORE)
        ray_cluster.wait_for_nodes()
        assert RayStarter(section, tmp_path).cuda_here()
        env = {"PYTHONPATH": str(tmp_path)}
        logs = [tmp_path / f"rank{k}.log" for k in range(2)]
        group, children = start_group("cuda-replica", "showgpu", [env, env], logs, cpus=1.0,
                                      gpus=1, prefer=None, wait_s=60)  # fmt: skip
        assert {c.node for c in children} == {gpu_node.node_id}
        for c in children:
            c.join(30)
        seen = sorted(p.read_text().strip() for p in logs)
        assert seen == ["CVD=0", "CVD=1"]  # one GPU each, not shared
        remove_group(group)
    finally:
        if gpu_node is not None:  # the shared cluster keeps its two CPU nodes only
            ray_cluster.remove_node(gpu_node)
        ray.shutdown()
