"""`libra train` as a Python API: parse, build, train, close (torchtitan's train.py).

    summary = run_sync(train(load_config("examples/cpu-train.toml")))

`train` prepares the run folder (new, or resumed from its checkpoint), builds the `Run`
(`libra.train.build`: model, env, tasks, hardware profile, warm start, placement,
trainer, engines, weight sync, loop), trains until `steps` or Ctrl-C, and closes it
(checkpoint, every process stopped, plots, summary).

Ctrl-C (or SIGTERM) once: stop admitting, finish the step in progress, save a checkpoint,
stop everything; the same command resumes. Twice (or once before training began): stop
at once (the last periodic checkpoint stays resumable). No process outlives the run:
engines are stopped (and die with it on Linux even if it is killed), trainer processes
are stopped by the trainer.
"""

from __future__ import annotations

import asyncio
import json
import resource
import signal
import time
from pathlib import Path
from typing import Any

from libra.errors import LibraError, disk_full, full_reason
from libra.train.build import Run, build_run
from libra.train.config import TrainConfig
from libra.train.display import Display, View
from libra.train.guards import going_on
from libra.train.loop import Telemetry
from libra.train.report import Report, write_plots
from libra.train.setup import summarize
from libra.train.state import prepare_out, read_state, write_json


class _Stop:
    """Ctrl-C / SIGTERM: the first asks the loop to stop at a step boundary, the
    second (or one before the loop runs) cancels the run."""

    def __init__(self, task: asyncio.Task[Any]):
        self.task = task
        self.run: Run | None = None
        self.count = 0
        self.requested = False

    def __call__(self) -> None:
        self.count += 1
        self.requested = True
        if self.count == 1 and self.run is not None:
            self.run.loop.request_stop()
        else:
            self.task.cancel()


async def train(cfg: TrainConfig, *, fresh: bool = False) -> dict[str, Any]:
    """Run (or resume) the training job `cfg`; returns the summary."""
    from libra.train.placement import launcher

    t0, cpu0 = time.time(), _cpu()
    engines = launcher(cfg)  # a vllm fleet is checked before anything is written
    out, state = prepare_out(cfg, fresh=fresh)
    if state is not None and int(state["version"]) >= cfg.steps:
        return _already_done(cfg, out, int(state["version"]))
    report = Report(out, tensorboard=cfg.report.tensorboard,
                    wandb=cfg.public() if cfg.report.wandb else None)  # fmt: skip
    display = Display(cfg.report.display)
    view = View(env=cfg.data.env, steps=cfg.steps)
    task = asyncio.current_task()
    assert task is not None
    stop = _Stop(task)
    aloop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        aloop.add_signal_handler(sig, stop)
    outcome = "failed"
    try:
        display.line(
            f"libra train: {'resuming' if state else 'starting'} run in {out}"
            + (f" at step {state['version']}" if state else "")
        )
        telemetry = Telemetry(report, display, view)
        run = await build_run(cfg, out, state, engines, telemetry, lambda: stop.requested)
        try:
            stop.run = run
            outcome = await run.train()
        except asyncio.CancelledError:
            outcome = "cancelled"
            if not stop.requested:
                raise
        finally:
            stop.run = None
            await run.close()
    except asyncio.CancelledError:
        outcome = "cancelled"
        if not stop.requested:
            raise
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            aloop.remove_signal_handler(sig)
        report.close()
    plots = write_plots(out) if cfg.report.plots else []
    summary = summarize(cfg, out, outcome, time.time() - t0, _cpu() - cpu0, plots)
    write_json(out / "summary.json", summary)
    return summary


def _already_done(cfg: TrainConfig, out: Path, version: int) -> dict[str, Any]:
    """The run in `out` is at `steps` already (e.g. `make run` again): start nothing, and
    say so. Outcome `already-done`; the last run's summary rides along (`last_outcome`,
    its figures), so that nobody takes it for a new run."""
    saved = out / "summary.json"
    if saved.is_file():
        last: dict[str, Any] = json.loads(saved.read_text())
    else:  # stopped between its last checkpoint and its summary
        last = summarize(cfg, out, "done", 0.0, 0.0, write_plots(out) if cfg.report.plots else [])
    return {**last, "outcome": "already-done", "last_outcome": last["outcome"],
            "trained_steps": version, "requested_steps": cfg.steps}  # fmt: skip


def _cpu() -> float:
    """CPU seconds of this process and every child it has waited for (engines, trainer)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


EXIT_CODES = {"done": 0, "already-done": 3, "interrupted": 130, "cancelled": 130}
"""`libra train`'s exit status by outcome; any other is 1, bad input 2. `already-done`
(3): nothing ran, the run in `out` had reached `steps` (a script can tell it from a
finished training, 0)."""


def run_cli(cfg: TrainConfig, *, fresh: bool) -> tuple[dict[str, Any], int]:
    """The CLI's entry: (summary, exit code)."""
    from libra.rollout.run import run_sync

    try:
        summary = run_sync(train(cfg, fresh=fresh))
    except BaseException as e:
        full = disk_full(e)
        if full is None:
            raise
        state = read_state(Path(cfg.out))
        then = going_on(int(state["version"]) if state else 0)
        raise LibraError(
            f"{full_reason(full)}; training stopped and every process with it. Free space "
            f"under {cfg.out} (or set out to another disk); the same command {then}"
        ) from None
    return summary, EXIT_CODES.get(summary["outcome"], 1)


__all__ = ["EXIT_CODES", "run_cli", "train"]
