"""One submitted batch: its request (as stored in `batch.json`), episode specs, spool,
runner and running episode tasks."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from libra import usercode
from libra.endpoints.config import SamplingConfig
from libra.record import Trajectory
from libra.rollout.batch import Runner
from libra.rollout.episode import EpisodeSpec
from libra.rollout.inputs import check_prompt
from libra.rollout.tasks import episode_specs, repeated_id, task_id
from libra.service.config import SubmitRequest
from libra.service.errors import RequestError
from libra.service.spool import Spool

BatchState = Literal["running", "done", "cancelled"]

MAX_TASK_ID = 256
"""Characters of a submitted task's id (one of 1,000,000 made a 300-episode batch's
spool 860 MB and held the loop seconds when it was cancelled)."""


@dataclass(eq=False)
class Batch:
    id: str
    doc: dict[str, Any]
    """The stored request: env, tasks, group_size, sampling (effective), step, digest."""
    specs: list[EpisodeSpec]
    spool: Spool
    runnable: bool
    """Running, and its env is hosted: episodes may run."""
    runner: Runner | None = None
    """Started when its first episode is admitted (an agent env's runner holds a proxy
    server), closed when the batch completes."""
    stack: contextlib.AsyncExitStack | None = None
    state: BatchState = "running"
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    """Running episodes by id."""
    queued_since: float = field(default_factory=time.monotonic)
    completing: bool = False
    readers: int = 0
    """Open streams of this batch (a finished batch stays loaded while it has any)."""

    @property
    def total(self) -> int:
        return len(self.specs)

    @property
    def complete(self) -> bool:
        return self.spool.written >= self.total

    def missing(self) -> list[EpisodeSpec]:
        """Specs without a record in the spool, in submit order."""
        return [s for s in self.specs if s.id not in self.spool.ids]

    def aborted(self, spec: EpisodeSpec, why: str) -> Trajectory:
        return Trajectory(
            id=spec.id,
            batch_id=spec.batch_id,
            task_id=spec.task_id,
            group_id=spec.group_id,
            env=self.doc["env"],
            step=spec.step,
            status="aborted",
            error=why,
        )


def request_digest(doc: dict[str, Any]) -> str:
    """What makes two submits the same batch (for idempotency): everything but the id.
    A weight other than 1 counts; the default leaves the digest as it was before batches
    had weights (a spool written then still matches its resubmits)."""
    keys = ("env", "tasks", "group_size", "sampling", "step")
    fields = {k: doc.get(k) for k in keys}
    if doc.get("weight", 1.0) != 1.0:
        fields["weight"] = doc["weight"]
    blob = orjson.dumps(fields, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(blob).hexdigest()


def submit_digest(req: SubmitRequest, base: SamplingConfig) -> str:
    """`request_digest` of a submit request, with the sampling the batch runs with (the
    service's `base` with the keys the request names): over the request's own fields,
    a body naming `max_tokens: 512` matched a batch that runs with the service's 16,
    and the very body that matched it was refused."""
    return request_digest({"env": req.env, "tasks": req.tasks, "group_size": req.group_size,
                           "sampling": req.sampling_over(base).model_dump(mode="json"),
                           "step": req.step, "weight": req.weight})  # fmt: skip


def specs_for(doc: dict[str, Any]) -> list[EpisodeSpec]:
    return list(episode_specs(doc["tasks"], doc["group_size"], doc["batch_id"], doc["step"]))


def check_tasks(tasks: list[dict[str, Any]], prompt: Any) -> None:
    """Unique task ids; every task renders a prompt (else 400 naming the task); `prompt`
    None: the env writes its own prompts (an agent function)."""
    for i, task in enumerate(tasks):
        if len(tid := task_id(task)) > MAX_TASK_ID:
            raise RequestError(
                400, f"tasks[{i}]: an id of {len(tid):,} characters; ids name every episode "
                f"and record of the task (three times each): give at most {MAX_TASK_ID}",
            )  # fmt: skip
    if (twin := repeated_id(tasks)) is not None:
        i, first, tid = twin
        raise RequestError(
            400, f"tasks[{i}] repeats the id {tid!r} of tasks[{first}]; ids must be unique"
        )
    for i, task in enumerate(tasks if prompt is not None else ()):
        try:
            check_prompt(prompt(task))
        except BaseException as e:  # the env's code, in a worker thread: even SystemExit
            raise RequestError(
                400, f"tasks[{i}]: the env cannot build a prompt from it: {usercode.describe(e)}"
            ) from None


__all__ = ["Batch", "BatchState", "check_tasks", "request_digest", "specs_for", "submit_digest"]
