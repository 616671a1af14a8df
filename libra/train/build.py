"""A `libra train` run as a built object: `build_run(...) -> Run`, then `run.train()`,
`run.checkpoint()`, `run.close()`.

Building, in order: the model (a folder, or a tiny one made for the run), env, tasks,
the planner's hardware profile, the supervised warm start (skipped on resume), the
starting roles, the placement of every worker (`libra.train.placement`), then the
trainer and the engines (started side by side), the weight sync that connects them,
and the loop. Every component is handed what it needs; none holds the `Run`.

The `Run` owns every process it started: `close` stops the engines and the trainer in
order (also after an error or a cancel half-way through building).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libra.chat import ChatTokenizer
from libra.cluster.engines import EngineLauncher
from libra.endpoints.config import SamplingConfig
from libra.endpoints.pool import EndpointPool
from libra.errors import ConfigError, EndpointDown, EnvError, TrainerError
from libra.rollout.batch import Runner
from libra.rollout.layouts import adapt_tasks
from libra.rollout.run import close_env, episode_runner, load_env, make_policy
from libra.rollout.serving import model_context, resolve_buckets
from libra.rollout.sink import JsonlSink
from libra.rollout.tasks import load_tasks, task_id, unique_ids
from libra.rollout.worker import HostedEnv, WorkerInit
from libra.rollout.worker_runners import ParsedRunner
from libra.rollout.workers import BatchInfo, WorkerPool, split_limits, worker_buckets
from libra.routing.base import RoutingPolicy
from libra.train import placement
from libra.train.admission import StalenessGate
from libra.train.config import TrainConfig
from libra.train.display import View
from libra.train.groups import TaskStream
from libra.train.handle import TrainerHandle
from libra.train.loop import Loop, Telemetry
from libra.train.planning import Assignment, Replanner, SwitchCosts
from libra.train.reconfig import Reconfigurer
from libra.train.report import SUPERSEDED, Report, set_aside_groups, truncate_after
from libra.train.rollouts import Rollouts
from libra.train.setup import (
    calibrate,
    make_replanner,
    planning_demos,
    prepare_model,
    trainer_config,
    warm_start,
)
from libra.train.state import LoopState, write_json
from libra.train.validation import Validation
from libra.train.workers import Fleet
from libra.weights import BroadcastSync, FolderSync, Weights, WeightSync


@dataclass(eq=False, slots=True)
class Checkpointer:
    """Writes what a resume needs (docs: `libra.train.state`)."""

    out: Path
    trainer: TrainerHandle
    fleet: Fleet
    policy: RoutingPolicy
    stream: TaskStream
    replanner: Replanner | None
    state: LoopState
    report: Report

    @property
    def path(self) -> Path:
        return self.out / "checkpoint"

    async def save(self) -> None:
        """Trainer state to `out/checkpoint`, the routing tree, then what the loop needs
        to resume (`state.json`, written atomically after the checkpoint: the state
        always names a checkpoint that exists)."""
        try:
            await self.trainer.save_checkpoint(str(self.path))
        except TrainerError as e:  # the earlier checkpoint stands (a save swaps in whole)
            free = shutil.disk_usage(self.out).free
            raise TrainerError(f"saving the checkpoint failed: {e}; {free / 2**20:,.0f} MiB "
                               f"free under {self.out}") from None  # fmt: skip
        save = getattr(self.policy, "save", None)
        if save is not None:
            await asyncio.to_thread(save)
        r = self.replanner
        doc = {
            "version": self.trainer.version,
            "stream": self.stream.position,
            "hybrids_training": len(self.fleet.hybrids("train")),
            "loop": dataclasses.asdict(self.state),
            "planner": {
                "last_replan_step": r.policy.last_replan_step,
                "last_change_step": r.policy.last_change_step,
            }
            | r.state()
            if r
            else None,
        }
        await asyncio.to_thread(write_json, self.out / "state.json", doc)
        self.report.event("checkpoint", version=self.trainer.version, path=str(self.path))


@dataclass(eq=False, slots=True)
class Run:
    """A built run: its parts, and the stack that stops them (`close`)."""

    trainer: TrainerHandle
    fleet: Fleet
    weights: WeightSync
    loop: Loop
    checkpointer: Checkpointer
    view: View
    stack: contextlib.AsyncExitStack

    async def train(self) -> str:
        """Train to `steps` (or until Ctrl-C), then a final checkpoint if the last step
        has none, and the weights as an HF folder (`out/model`). Returns `done` or
        `interrupted`. An engine that dies is replaced on its devices (`Fleet.watch`);
        one that dies again past `fleet.engine_restarts` fails the run at once
        (`EndpointDown`)."""
        self.view.phase, self.view.step = "training", self.trainer.version
        self.view.switches = self.loop.state.switches
        try:
            async with asyncio.TaskGroup() as tg:
                watcher = tg.create_task(self.fleet.watch(on_event=self.loop.report.event),
                                         name="libra-engine-watch")  # fmt: skip
                outcome = await self.loop.run()
                watcher.cancel()
        except* (EndpointDown, EnvError, TrainerError) as group:  # one line, not a group
            raise _first(group) from None
        ckpt = self.checkpointer
        if self.loop.checkpointed != self.trainer.version or not ckpt.path.is_dir():
            await self.checkpoint()
        # the checkpoint is shards for a resume; what to serve is an HF folder
        await self.trainer.save_weights(str(ckpt.out / "model"))
        return outcome

    async def checkpoint(self) -> None:
        await self.checkpointer.save()

    async def close(self) -> None:
        """Stop everything the run started (engines, then the trainer)."""
        self.view.phase = "stopping"
        await self.stack.aclose()


async def build_run(
    cfg: TrainConfig,
    out: Path,
    saved: dict[str, Any] | None,
    launcher: EngineLauncher,
    telemetry: Telemetry,
    should_stop: Callable[[], bool],
) -> Run:
    """Everything up to the loop (module doc); `saved` is the state of a run being
    resumed. On failure (or cancel) whatever was started is stopped again."""
    async with contextlib.AsyncExitStack() as stack:
        report, display, view = telemetry.report, telemetry.display, telemetry.view
        resumed = saved is not None
        view.phase = "preparing"
        base = await prepare_model(cfg, out)
        # the buckets' bounds before the warm start (their error came after it: minutes)
        max_context = cfg.rollout.limits.max_context or model_context(Path(base)) or 4096
        buckets = resolve_buckets(list(cfg.fleet.buckets), max_context)
        env = load_env(cfg.data.env, cfg.data.env_options)
        stack.push_async_callback(close_env, env)
        tasks, val_tasks = train_tasks(cfg, env)
        tok = ChatTokenizer(base)
        hw = await calibrate(cfg, out, base, view)
        demos: list[Any] = []
        if resumed:
            start = out / "sft" if (out / "sft").is_dir() else base
        else:
            start, demos = await warm_start(
                cfg, out, base, env, tok, tasks, view, display, report, should_stop
            )
        if not resumed and not demos and cfg.fleet.hybrid_start == "plan" and cfg.fleet.hybrids:
            demos = await planning_demos(cfg, env, tok, tasks)  # no warm start: plan on these
        replanner = make_replanner(cfg, start, hw)
        version = int(saved["version"]) if saved else 0
        current = Weights(version, str(start))
        if resumed:
            current = await _resumed_weights(cfg, out, start, version)
        workers = placement.workers(cfg, _starting_roles(cfg, replanner, demos, saved, report))
        where = placement.placement(cfg, workers)
        state = LoopState.from_dict(saved["loop"]) if saved else LoopState()

        view.phase, view.note = "starting the fleet", ""
        from libra.trainer import ElasticTrainer

        resume = str(out / "checkpoint") if resumed else None
        starter = placement.rank_starter(cfg, out / "logs")
        gpus = placement.trainer_gpus(cfg, where, workers)  # None: the trainer deals
        core_gpus = [gpus[w.id] for w in workers if w.kind == "core-train"] if gpus else None
        trainer = TrainerHandle(
            ElasticTrainer(
                trainer_config(cfg, start, gpus), resume=resume, starter=starter,
                core_gpus=core_gpus,
            )
        )  # fmt: skip
        stack.push_async_callback(trainer.close)
        pool = EndpointPool([(b, []) for b in buckets], cfg.rollout.endpoint, joined_later=True)
        weights = weight_sync(
            cfg, trainer, pool, launcher.kind, out,
            # a resumed run's engines start on its checkpoint; later ones on a folder that is
            # never rewritten, then take the newest
            origin=Weights(-1 if resumed else version, str(start)),
            current=current,
        )  # fmt: skip
        fleet = Fleet(
            workers,
            launcher=launcher,
            placement=where,
            weights=weights,
            bucket_tp={b.name: b.tp for b in cfg.fleet.buckets},
            log_dir=out / "logs",
            drain_timeout_s=cfg.fleet.drain_timeout_s,
            restarts=cfg.fleet.engine_restarts,
            train_gpus=gpus,
        )
        stack.push_async_callback(_stop_engines, fleet)
        await stack.enter_async_context(pool)
        t_start = time.monotonic()
        await asyncio.gather(trainer.start(), fleet.start())
        for w in fleet.hybrids("train"):
            await trainer.add_hybrid(w.id, gpus=fleet.train_gpus.get(w.id))
        trained = await trainer.nodes()
        for w in workers:  # on Ray: the nodes the training replicas got
            if w.role == "train":
                placement.trained_on(where, w.id, trained)
        if isinstance(weights, BroadcastSync) and (sender := await trainer.sender_host()):
            weights.host = sender  # engines connect to the node rank 0 of core0 runs on
        replicas = await trainer.replicas()
        trainer_start_s = next((r.start_s for r in replicas if r.start_s), 10.0)
        if not resumed:
            engine_s = max(fleet.engine_start_s, default=10.0)
            state.costs = SwitchCosts(
                to_train_s=trainer_start_s + 1.0,
                to_rollout_s=cfg.planner.engine_start_s or engine_s,
            )
        report.event(
            "fleet-started",
            wall_s=time.monotonic() - t_start,
            engine_start_s=fleet.engine_start_s,
            trainer_start_s=trainer_start_s,
            roles=fleet.by_role(),
            placement=where.by_worker(),
            nodes=where.nodes(),
        )

        routing = {"tree_path": str(out / "routing-tree.json"), **cfg.rollout.routing}
        policy = make_policy(cfg.rollout.policy, pool.buckets, routing)
        sampling = cfg.rollout.sampling
        if sampling.seed is None:
            sampling = sampling.model_copy(update={"seed": cfg.seed * 1_000_003})
        if cfg.rollout.workers > 1:
            on = await _rollout_workers(stack, cfg, base, pool, routing, max_context)

            async def open_runner(s: SamplingConfig, batch: str) -> Runner:
                info = BatchInfo(batch, cfg.data.env, s.model_dump(mode="json"))
                return ParsedRunner(on.runner(info, policy), policy)
        else:
            common: dict[str, Any] = {"env_name": cfg.data.env, "tokenizer": tok, "pool": pool,
                                      "policy": policy, "limits": cfg.rollout.limits,
                                      "max_context": max_context}  # fmt: skip

            async def open_runner(s: SamplingConfig, batch: str) -> Runner:
                return await stack.enter_async_context(episode_runner(env, sampling=s, **common))

        runner = await open_runner(sampling, "train")
        validation = None
        if val_tasks:
            vs = sampling.model_copy(update={"temperature": cfg.validation.temperature, "seed": 7})
            val_runner = await open_runner(vs, "validation")
            validation = Validation(val_runner, val_tasks, cfg.validation.every, cfg.steps)
        r = cfg.rollout
        gate = StalenessGate(r.batch_groups, r.max_staleness,
                             r.dynamic_sampling.max_replacements, version=version)  # fmt: skip
        stream = TaskStream(tasks, cfg.seed, int(saved["stream"]) if saved else 0)
        if saved is not None:  # before the sink appends to the file
            moved = set_aside_groups(out / "trajectories.jsonl", int(saved["stream"]))
            if moved:
                display.line(f"libra train: {moved} episodes recorded after the checkpoint "
                             f"moved to {SUPERSEDED} (their groups are sampled again)")  # fmt: skip
        trajectories = JsonlSink(out / "trajectories.jsonl")
        stack.callback(trajectories.close)
        if resumed:
            truncate_after(out / "metrics.jsonl", version)
        if replanner is not None and saved and saved.get("planner"):
            replanner.policy.last_replan_step = saved["planner"]["last_replan_step"]
            replanner.policy.last_change_step = saved["planner"]["last_change_step"]
            replanner.restore(saved["planner"])

        def in_flight(n: int) -> None:
            view.in_flight += n

        rollouts = Rollouts(r, runner, gate, stream, trajectories, on_count=in_flight)
        reconfig = Reconfigurer(
            replanner=replanner if cfg.planner.adapt else None, fleet=fleet,
            trainer=trainer, state=state, report=report, view=view, steps=cfg.steps,
            decode_slots=cfg.fleet.engine_max_num_seqs, bucket=buckets[0].name,
        )  # fmt: skip
        ckpt = Checkpointer(out, trainer, fleet, policy, stream, replanner, state, report)
        loop = Loop(
            steps=cfg.steps, checkpoint_every=cfg.report.checkpoint_every,
            max_skipped=cfg.trainer.max_skipped_updates,
            max_failed=cfg.rollout.max_failed_steps, rollouts=rollouts,
            trainer=trainer, weights=weights, reconfig=reconfig, validation=validation,
            telemetry=telemetry, state=state, checkpoint=ckpt.save,
            roles=fleet.by_role, on_lost=lambda lost: fleet.replace_lost(lost, report.event),
        )  # fmt: skip
        # built: the run owns what it started (until then, a failure stops it again)
        return Run(trainer, fleet, weights, loop, ckpt, view, stack.pop_all())


def _first(group: BaseExceptionGroup) -> BaseException:
    """The first error of a task group's, unwrapped from nested groups."""
    e: BaseException = group
    while isinstance(e, BaseExceptionGroup):
        e = e.exceptions[0]
    return e


def weight_sync(
    cfg: TrainConfig,
    trainer: TrainerHandle,
    pool: EndpointPool,
    kind: Any,
    out: Path,
    *,
    origin: Weights,
    current: Weights,
) -> WeightSync:
    """`weights.transport`: broadcast from the trainer's memory, or folders on disk."""
    w = cfg.weights
    if w.transport == "broadcast":
        ranks = {b.name: (b.tp if kind == "vllm" else 1) for b in cfg.fleet.buckets}
        return BroadcastSync(sender=trainer, pool=pool, kind=kind, origin=origin,
                             current=current, host=w.host, ranks=ranks,
                             bucket_bytes=w.bucket_mb << 20, timeout_s=w.timeout_s)  # fmt: skip
    return FolderSync(write=trainer.save_weights, root=out / "weights",
                      keep=cfg.trainer.keep_versions, pool=pool, kind=kind, origin=origin,
                      current=current)  # fmt: skip


async def _resumed_weights(cfg: TrainConfig, out: Path, source: Path, version: int) -> Weights:
    """The checkpoint's weights, which a resumed run's engines are brought to. Broadcast
    sends them from the trainer's memory; folders on disk need an HF folder, exported
    from the checkpoint's shards to that version's folder (`weights/v{N}`)."""
    if cfg.weights.transport == "broadcast":
        return Weights(version, "")  # as after a broadcast publication: no folder
    from libra.trainer.checkpoint import export_model
    from libra.weights.folder import version_dir

    folder = version_dir(out / "weights", version)
    await asyncio.to_thread(export_model, out / "checkpoint", folder, source)
    return Weights(version, str(folder))


async def _rollout_workers(
    stack: contextlib.AsyncExitStack,
    cfg: TrainConfig,
    model: Path,
    pool: EndpointPool,
    routing: dict[str, Any],
    max_context: int,
) -> WorkerPool:
    """`rollout.workers` processes that run the episodes; they follow `pool`, which the
    fleet and the weight sync keep changing, and stop before it does."""
    r, n = cfg.rollout, cfg.rollout.workers
    hosted = HostedEnv(name=cfg.data.env, spec=cfg.data.env, options=cfg.data.env_options)

    def init() -> WorkerInit:  # also for a replacement: the pool as it is then
        eps = pool.endpoints()
        return WorkerInit(
            model=str(model), max_context=max_context, buckets=worker_buckets(pool),
            endpoint=split_limits(r.endpoint, n), limits=r.limits, envs=[hosted],
            policy=r.policy, routing=routing, versions={e.url: e.version for e in eps},
            paused=[e.url for e in eps if not e.admitting], joined_later=True,
        )  # fmt: skip

    workers = await stack.enter_async_context(WorkerPool(n, init))
    pool.followers.append(workers)
    stack.callback(pool.followers.remove, workers)
    return workers


async def _stop_engines(fleet: Fleet) -> None:
    try:
        await fleet.close()
    finally:
        fleet.kill_now()


def train_tasks(cfg: TrainConfig, env: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training tasks and the held-out validation tasks of `cfg` (`data.*`)."""
    path = cfg.data.train or env.default_tasks()
    if path is None:
        raise ConfigError(f"env {cfg.data.env!r} ships no tasks; set data.train")
    fields, env_id = getattr(env, "task_fields", None), cfg.data.env
    tasks = adapt_tasks(_load(path, "data.train"), fields, env=env_id, source=str(path))
    unique_ids(tasks, f"data.train: {path}")
    if not tasks:
        raise ConfigError(f"data.train: {path} holds no tasks")
    if cfg.data.val is None:
        return tasks, []
    seen = {task_id(t) for t in tasks}
    val_tasks = adapt_tasks(_load(cfg.data.val, "data.val"), fields, env=env_id,
                            source=cfg.data.val)  # fmt: skip
    unique_ids(val_tasks, f"data.val: {cfg.data.val}")
    val = [t for t in val_tasks if task_id(t) not in seen]
    if not val:
        raise ConfigError(f"data.val: {cfg.data.val} has no task that is not also in data.train")
    return tasks, val[: cfg.validation.tasks]


def _load(path: str | Path, key: str) -> list[dict[str, Any]]:
    try:
        return load_tasks(path, 0)
    except ConfigError as e:
        raise ConfigError(f"{key}: {e}") from None


def _starting_roles(
    cfg: TrainConfig,
    replanner: Replanner | None,
    demos: list[Any],
    saved: dict[str, Any] | None,
    report: Report,
) -> int:
    """How many hybrids start in training (and the planner's current assignment)."""
    start = cfg.fleet.hybrid_start
    if saved is not None:  # resume: the roles at the checkpoint
        n = int(saved.get("hybrids_training", 0))
    elif start == "train":
        n = cfg.fleet.hybrids
    elif start == "plan" and replanner is not None and demos:
        from libra.planner import WorkloadStats
        from libra.train.planning import Workload

        per_step = cfg.rollout.batch_groups * cfg.rollout.group_size
        stats = WorkloadStats.from_records(demos).resample(per_step)
        report.decision(replanner.initial(Workload(rollout=stats, train=stats)))
        n = replanner.current.train
    else:
        n = 0
    if replanner is not None:
        replanner.current = Assignment(n, cfg.fleet.hybrids, replanner.shape.layout)
    return n


__all__ = ["Checkpointer", "Run", "build_run", "train_tasks"]
