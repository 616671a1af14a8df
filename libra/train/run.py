"""`libra train` as a Python API: the whole run, from an empty folder to a report.

    summary = run_sync(train(load_config("examples/cpu-train.toml")))

1. the run folder (new, or resumed from its checkpoint);
2. the model (a folder, or a tiny one made for the run), env, tasks;
3. the hardware profile (`local`: measured here; saved for resumes);
4. the supervised warm start on expert demonstrations (skipped on resume);
5. the fleet: core engines + hybrids in their starting roles, the elastic trainer;
6. the asynchronous GRPO loop (`libra.train.loop`) until `steps`, or Ctrl-C;
7. checkpoint, stop every process, plots, summary.

Ctrl-C (or SIGTERM) once: stop admitting, finish the step in progress, save a checkpoint,
stop everything; the same command resumes. Twice: stop at once (the last periodic
checkpoint stays resumable). No process outlives the run: engines are stopped (and die
with it on Linux even if it is killed), trainer processes are stopped by the trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import resource
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from libra.chat import ChatTokenizer
from libra.endpoints.pool import EndpointPool
from libra.errors import ConfigError, EndpointDown
from libra.rollout.episode import EpisodeRunner
from libra.rollout.fleet import model_context, resolve_buckets
from libra.rollout.run import load_env, make_policy
from libra.rollout.sink import JsonlSink
from libra.rollout.tasks import load_tasks, task_id
from libra.train.admission import StalenessGate
from libra.train.config import TrainConfig
from libra.train.display import Display, View
from libra.train.engines import EmbeddedLauncher, Launcher
from libra.train.fleet import Fleet, TrainerHandle, Worker
from libra.train.groups import TaskStream
from libra.train.loop import Loop, LoopState
from libra.train.planning import SwitchCosts
from libra.train.report import Report, truncate_after, write_plots
from libra.train.setup import (
    calibrate,
    make_replanner,
    prepare_model,
    summarize,
    trainer_config,
    warm_start,
)
from libra.train.state import prepare_out, write_json

log = logging.getLogger("libra.train")


class _Stop:
    """Ctrl-C / SIGTERM: the first asks the loop to stop at a step boundary, the
    second (or one before the loop runs) cancels the run."""

    def __init__(self, task: asyncio.Task[Any]):
        self.task = task
        self.loop: Loop | None = None
        self.count = 0
        self.requested = False

    def __call__(self) -> None:
        self.count += 1
        self.requested = True
        if self.count == 1 and self.loop is not None:
            self.loop.request_stop()
        else:
            self.task.cancel()


async def train(cfg: TrainConfig, *, fresh: bool = False) -> dict[str, Any]:
    """Run (or resume) the training job `cfg`; returns the summary."""
    t0, cpu0 = time.time(), _cpu()
    launcher = _launcher(cfg)  # a vllm fleet is checked before anything is written
    out, state = prepare_out(cfg, fresh=fresh)
    if state is not None and int(state["version"]) >= cfg.steps:
        # already trained to `steps` (e.g. `make run` again): report it, start nothing
        saved = out / "summary.json"
        if saved.is_file():
            done: dict[str, Any] = json.loads(saved.read_text())
            return done
        plots = write_plots(out) if cfg.report.plots else []
        return summarize(cfg, out, "done", 0.0, 0.0, plots)
    report = Report(out, tensorboard=cfg.report.tensorboard)
    display = Display(cfg.report.display)
    view = View(env=cfg.data.env, steps=cfg.steps)
    task = asyncio.current_task()
    assert task is not None
    stop = _Stop(task)
    aloop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        aloop.add_signal_handler(sig, stop)
    try:
        return await _train(cfg, out, state, report, display, view, stop, t0, cpu0, launcher)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            aloop.remove_signal_handler(sig)
        report.close()


async def _train(
    cfg: TrainConfig,
    out: Path,
    state: dict[str, Any] | None,
    report: Report,
    display: Display,
    view: View,
    stop: _Stop,
    t0: float,
    cpu0: float,
    launcher: Launcher,
) -> dict[str, Any]:
    resumed = state is not None
    display.line(
        f"libra train: {'resuming' if resumed else 'starting'} run in {out}"
        + (f" at step {state['version']}" if state else "")
    )
    view.phase = "preparing"
    base = await prepare_model(cfg, out)
    env = load_env(cfg.data.env, cfg.data.env_options)
    tasks, val_tasks = _tasks(cfg, env)
    tok = ChatTokenizer(base)
    hw = await calibrate(cfg, out, base, view)
    demos: list[Any] = []
    if resumed:
        start = out / "sft" if (out / "sft").is_dir() else base
    else:
        start, demos = await warm_start(
            cfg, out, base, env, tok, tasks, view, display, report, lambda: stop.requested
        )
    replanner = make_replanner(cfg, start, hw)
    version = int(state["version"]) if state else 0
    serve = out / "checkpoint" if resumed else start
    assignment = _starting_roles(cfg, replanner, demos, state, report)

    view.phase, view.note = "starting the fleet", ""
    trainer = None
    handle: TrainerHandle | None = None
    fleet: Fleet | None = None
    loop_state = LoopState(**state["loop"]) if state else LoopState()
    if isinstance(loop_state.costs, dict):
        loop_state.costs = SwitchCosts(**loop_state.costs)
    outcome = "failed"
    try:
        from libra.trainer import ElasticTrainer

        tcfg = trainer_config(cfg, start, out)
        trainer = ElasticTrainer(tcfg, resume=str(out / "checkpoint") if resumed else None)
        handle = TrainerHandle(trainer)
        fleet = Fleet(
            pool=None,
            trainer=handle,
            log_dir=out / "logs",
            launcher=launcher,
            bucket_tp={b.name: b.tp for b in cfg.fleet.buckets},
            drain_timeout_s=cfg.fleet.drain_timeout_s,
        )
        workers = _workers(cfg, assignment)
        t_start = time.monotonic()
        await asyncio.gather(
            handle.call(trainer.start),
            fleet.start(workers, str(serve), version),
        )
        if serve != start:  # resumed: later engines start on a folder that is never
            fleet.start_weights = (-1, str(start))  # rewritten, then load the newest
        for w in workers:
            if w.kind == "hybrid" and w.role == "train":
                await handle.call(trainer.add_hybrid, w.id)
        trainer_start_s = next((r.start_s for r in trainer.replicas() if r.start_s), 10.0)
        if not resumed:
            engine_s = max(fleet.engine_start_s, default=10.0)
            loop_state.costs = SwitchCosts(
                to_train_s=trainer_start_s + 1.0,
                to_rollout_s=cfg.planner.engine_start_s or engine_s,
            )
        report.event(
            "fleet-started",
            wall_s=time.monotonic() - t_start,
            engine_start_s=fleet.engine_start_s,
            trainer_start_s=trainer_start_s,
            roles=fleet.by_role(),
        )

        max_context = cfg.rollout.limits.max_context or model_context(Path(base)) or 4096
        buckets = resolve_buckets(list(cfg.fleet.buckets), max_context)
        urls = fleet.urls()
        pool = EndpointPool([(b, urls.get(b.name, [])) for b in buckets], cfg.rollout.endpoint)
        fleet.pool = pool
        async with pool, contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(env.close)
            pool.set_version(version)
            routing = {"tree_path": str(out / "routing-tree.json"), **cfg.rollout.routing}
            policy = make_policy(cfg.rollout.policy, pool.buckets, routing)
            sampling = cfg.rollout.sampling
            if sampling.seed is None:
                sampling = sampling.model_copy(update={"seed": cfg.seed * 1_000_003})
            common: dict[str, Any] = {
                "env": env,
                "env_name": cfg.data.env,
                "tokenizer": tok,
                "pool": pool,
                "policy": policy,
                "limits": cfg.rollout.limits,
                "max_context": max_context,
            }
            runner = EpisodeRunner(sampling=sampling, **common)
            val_runner = None
            if val_tasks:
                vs = sampling.model_copy(
                    update={"temperature": cfg.validation.temperature, "seed": 7}
                )
                val_runner = EpisodeRunner(sampling=vs, **common)
            gate = StalenessGate(
                cfg.rollout.batch_groups,
                cfg.rollout.max_staleness,
                cfg.rollout.dynamic_sampling.max_replacements,
                version=version,
            )
            stream = TaskStream(tasks, cfg.seed, int(state["stream"]) if state else 0)
            trajectories = JsonlSink(out / "trajectories.jsonl")
            stack.callback(trajectories.close)

            async def checkpoint() -> None:
                assert handle is not None and trainer is not None and fleet is not None
                await handle.call(trainer.save_checkpoint, str(out / "checkpoint"))
                save = getattr(policy, "save", None)
                if save is not None:
                    await asyncio.to_thread(save)
                write_json(
                    out / "state.json",
                    {
                        "version": trainer.version,
                        "stream": stream.position,
                        "hybrids_training": len(fleet.hybrids("train")),
                        "loop": dataclasses.asdict(loop.state),
                        "planner": {
                            "last_replan_step": replanner.policy.last_replan_step,
                            "last_change_step": replanner.policy.last_change_step,
                        }
                        if replanner
                        else None,
                    },
                )
                report.event("checkpoint", version=trainer.version, path=str(out / "checkpoint"))

            if resumed:
                truncate_after(out / "metrics.jsonl", version)
            if replanner is not None and state and state.get("planner"):
                replanner.policy.last_replan_step = state["planner"]["last_replan_step"]
                replanner.policy.last_change_step = state["planner"]["last_change_step"]
            loop = Loop(
                cfg=cfg,
                runner=runner,
                val_runner=val_runner,
                val_tasks=val_tasks,
                fleet=fleet,
                trainer=handle,
                gate=gate,
                stream=stream,
                report=report,
                display=display,
                view=view,
                replanner=replanner,
                checkpoint=checkpoint,
                state=loop_state,
                trajectories=trajectories,
                bucket=buckets[0].name,
            )
            stop.loop = loop
            view.phase, view.step = "training", version
            view.phase_started = time.monotonic()
            view.switches = loop_state.switches
            outcome = await _run_watched(loop, fleet)
            stop.loop = None
            if loop.checkpointed != trainer.version or not (out / "checkpoint").is_dir():
                await checkpoint()
    except asyncio.CancelledError:
        outcome = "cancelled"
        if not stop.requested:
            raise
    finally:
        view.phase = "stopping"
        if fleet is not None:
            await fleet.close()
            fleet.kill_now()
        if trainer is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(asyncio.to_thread(trainer.close))
    plots = write_plots(out) if cfg.report.plots else []
    summary = summarize(cfg, out, outcome, time.time() - t0, _cpu() - cpu0, plots)
    write_json(out / "summary.json", summary)
    return summary


async def _run_watched(loop: Loop, fleet: Fleet) -> str:
    """`loop.run()`, failed at once (one `EndpointDown` line) when an engine dies."""
    try:
        async with asyncio.TaskGroup() as tg:
            watcher = tg.create_task(fleet.watch(), name="libra-engine-watch")
            outcome = await loop.run()
            watcher.cancel()
    except* EndpointDown as group:
        raise group.exceptions[0] from None
    return outcome


def _launcher(cfg: TrainConfig) -> Launcher:
    f = cfg.fleet
    if f.kind == "embedded":
        return EmbeddedLauncher(threads=f.engine_threads, max_num_seqs=f.engine_max_num_seqs)
    from libra.train import vllm_fleet

    python = vllm_fleet.check(cfg)
    return vllm_fleet.VllmLauncher(f.vllm, python, max_num_seqs=f.engine_max_num_seqs)


def _cpu() -> float:
    """CPU seconds of this process and every child it has waited for (engines, trainer)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _tasks(cfg: TrainConfig, env: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    path = cfg.data.train or env.default_tasks()
    if path is None:
        raise ConfigError(f"env {cfg.data.env!r} ships no tasks; set data.train")
    tasks = load_tasks(path, 0)
    if not tasks:
        raise ConfigError(f"data.train: {path} holds no tasks")
    if cfg.data.val is None:
        return tasks, []
    seen = {task_id(t) for t in tasks}
    val = [t for t in load_tasks(cfg.data.val, 0) if task_id(t) not in seen]
    if not val:
        raise ConfigError(f"data.val: {cfg.data.val} has no task that is not also in data.train")
    return tasks, val[: cfg.validation.tasks]


def _starting_roles(
    cfg: TrainConfig, replanner: Any, demos: list[Any], state: dict[str, Any] | None, report: Report
) -> int:
    """How many hybrids start in training (and the planner's current assignment)."""
    start = cfg.fleet.hybrid_start
    if state is not None:  # resume: the roles at the checkpoint
        n = int(state.get("hybrids_training", 0))
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
        from libra.train.planning import Assignment

        replanner.current = Assignment(n, cfg.fleet.hybrids, replanner.shape.layout)
    return n


def _workers(cfg: TrainConfig, hybrids_training: int) -> list[Worker]:
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


def run_cli(cfg: TrainConfig, *, fresh: bool) -> tuple[dict[str, Any], int]:
    """The CLI's entry: (summary, exit code)."""
    from libra.rollout.run import run_sync

    summary = run_sync(train(cfg, fresh=fresh))
    code = {"done": 0, "interrupted": 130, "cancelled": 130}.get(summary["outcome"], 1)
    return summary, code


Progress = Callable[[str], None]

__all__ = ["run_cli", "train"]
