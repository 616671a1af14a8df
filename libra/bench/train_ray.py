"""Ray vs local: `libra train` step time with its workers placed by Ray, against the
same run on local processes, in one invocation.

A local Ray cluster on this machine (`ray.cluster_utils.Cluster`: a head without CPUs
and three nodes of one logical CPU each, dashboard off) and the same small run twice per
round, alternated: `[cluster] backend = "local"` and `backend = "ray"` (two embedded
engines and the core training replica, one per node; tiny model, `arith`, no warm
start, the planner fixed). Reported per backend: the median step time over the steps
after the first (which includes the fleet's start), and of its two parts that placement
touches, the trainer's step (`train_s`) and the weight broadcast (`publish_s`); the
engine and trainer start times from `fleet-started`; and ray ÷ local for each median.
The whole step also waits on rollouts, whose length varies from run to run here
(dynamic sampling redraws groups of equal rewards), so its ratio is the noisiest. On
one machine Ray's own processes share the cores: the ratios are what placement through
Ray costs, not what a cluster gains.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

TINY_MODEL = """[model]
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 1
num_attention_heads = 2
num_key_value_heads = 2
max_position_embeddings = 1024
"""
"""The smallest model `libra train` builds here and in the tests (one layer of 64): a few
seconds a step."""

CONFIG = (
    """
out = "{out}"
seed = 5
steps = {steps}

"""
    + TINY_MODEL.replace("{", "{{").replace("}", "}}")
    + """
[data]
env = "arith"

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
display = "off"
plots = false

[cluster]
backend = "{backend}"
address = "{address}"
"""
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=6, help="GRPO steps per run")
    p.add_argument("--rounds", type=int, default=1, help="local/ray pairs, alternated")


def run(args: argparse.Namespace) -> dict[str, Any]:
    try:
        from ray.cluster_utils import Cluster
    except ImportError:
        from libra.errors import ConfigError

        raise ConfigError("libra bench train-ray needs Ray: pip install 'libra-rl[ray]'") from None
    small = 80 << 20
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "object_store_memory": small})  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {"local": [], "ray": []}
    try:
        for _ in range(3):  # two engines and the trainer's replica
            cluster.add_node(num_cpus=1, object_store_memory=small)
        cluster.wait_for_nodes()
        with tempfile.TemporaryDirectory(prefix="libra-bench-ray-") as tmp:
            for r in range(args.rounds):
                for backend in ("local", "ray"):
                    out = Path(tmp) / f"{backend}-{r}"
                    runs[backend].append(_one(out, backend, cluster.address, args.steps))
    finally:
        cluster.shutdown()
    doc: dict[str, Any] = {"steps": args.steps, "rounds": args.rounds}
    for backend, rs in runs.items():
        steps = [s for r in rs for s in r["step_s"][1:]]
        doc[backend] = {
            "step_s_median": round(statistics.median(steps), 3),
            # the parts placement touches: the trainer's step and the weight broadcast
            "train_s_median": round(statistics.median(s for r in rs for s in r["train_s"][1:]), 3),
            "publish_s_median": round(
                statistics.median(s for r in rs for s in r["publish_s"][1:]), 3
            ),
            "engine_start_s": [round(s, 2) for r in rs for s in r["engine_start_s"]],
            "trainer_start_s": [round(r["trainer_start_s"], 2) for r in rs],
            "nodes": sorted({n for r in rs for n in r["nodes"]}),
        }
    doc["ray_over_local"] = round(doc["ray"]["step_s_median"] / doc["local"]["step_s_median"], 3)
    for part in ("train_s", "publish_s"):
        doc[f"ray_over_local_{part}"] = round(
            doc["ray"][f"{part}_median"] / max(doc["local"][f"{part}_median"], 1e-9), 3
        )
    return doc


def _one(out: Path, backend: str, address: str, steps: int) -> dict[str, Any]:
    out.mkdir(parents=True)
    config = out.parent / f"{out.name}.toml"
    config.write_text(CONFIG.format(out=out, steps=steps, backend=backend, address=address))
    done = subprocess.run([sys.executable, "-m", "libra", "train", str(config)],
                          capture_output=True, text=True, timeout=1800, check=False)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"libra train ({backend}) failed: {done.stderr[-2000:]}")
    metrics = [orjson.loads(x) for x in (out / "metrics.jsonl").read_bytes().splitlines()]
    events = [orjson.loads(x) for x in (out / "events.jsonl").read_bytes().splitlines()]
    started = next(e for e in events if e["event"] == "fleet-started")
    return {
        "step_s": [m["step_s"] for m in metrics],
        "train_s": [m["train_s"] for m in metrics],
        "publish_s": [m["publish_s"] for m in metrics],
        "engine_start_s": list(started.get("engine_start_s") or []),
        "trainer_start_s": float(started.get("trainer_start_s") or 0.0),
        "nodes": sorted(set((started.get("nodes") or {}).values())),
    }


__all__ = ["add_arguments", "run"]
