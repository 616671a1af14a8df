"""Request bodies in, validated requests out, without stalling the event loop.

Parsing JSON (orjson) and validating it (pydantic) each hold the GIL for a whole call:
about 35 ms per MB of dense JSON here, so a 64 MB body of `[1,1,1,...]` would stop
every episode, stream and `/healthz` for two seconds even from a worker thread. So:

- a body up to `INLINE_BYTES` is parsed and validated in a worker thread (a few ms);
- a bigger one goes to a fresh `python -m libra.service.intake` process, which parses
  and validates it there and answers with one line of request fields, then each task
  as its own line of JSON (a task is at most `max_task_bytes`); this process reads the
  tasks back one at a time in a worker thread, so the GIL is never held for long and
  junk costs this process nothing.

Errors are `RequestError`s naming the problem (400), as for any bad submit.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Any, TypeVar

import orjson
from pydantic import ValidationError

from libra.config import Config, format_validation_error
from libra.endpoints.config import SamplingConfig
from libra.jsonlimits import MAX_DEPTH, deeper_than
from libra.service.config import SubmitRequest
from libra.service.errors import RequestError

M = TypeVar("M", bound=Config)
INLINE_BYTES = 1 << 20
"""Bodies up to this size are parsed in a worker thread of this process."""
CHILD_TIMEOUT_S = 120.0
CHILDREN = 2
"""Larger bodies checked at once, each in a child process (~70 MB of memory); the rest
wait for one to end (30 at once took 2 GB, and nothing bounded them: 300 would have
taken this machine's memory, with no token needed on loopback)."""
MAX_ERROR = 2000
"""Longest error message returned (a validation error may quote its input)."""


def parse_body(raw: bytes, model: type[M]) -> M:
    """A JSON body validated as `model` (blocking); `RequestError` (400) naming the
    problem otherwise."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise RequestError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(doc).__name__}")
    tasks = doc.get("tasks")
    if isinstance(tasks, list):  # the first bad task only (pydantic would list them all)
        for i, task in enumerate(tasks):
            if not isinstance(task, dict):
                raise RequestError(
                    400, f"tasks.{i}: Input should be a valid dictionary (got {task!r:.80})"
                )
            if deeper_than(task):
                raise RequestError(
                    400, f"tasks.{i}: nests lists and objects more than {MAX_DEPTH} "
                    "levels deep; flatten it (or keep such data in files the env reads)",
                )  # fmt: skip
    try:
        return model.model_validate(doc)
    except ValidationError as e:
        raise RequestError(400, format_validation_error(e)[:MAX_ERROR]) from None


async def parse_submit(
    raw: bytes, max_task_bytes: int, children: asyncio.Semaphore | None = None
) -> SubmitRequest:
    """`POST /v1/rollouts`' body as a `SubmitRequest` (see the module docstring);
    `children`: the app's bound on child processes at once (`CHILDREN`)."""
    if len(raw) <= INLINE_BYTES:
        req = await asyncio.to_thread(parse_body, raw, SubmitRequest)
        _check_task_sizes_inline(req, max_task_bytes)
        return req
    async with children or contextlib.nullcontext():
        return await _parse_in_child(raw, max_task_bytes)


async def _parse_in_child(raw: bytes, max_task_bytes: int) -> SubmitRequest:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "libra.service.intake", str(max_task_bytes),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with asyncio.timeout(CHILD_TIMEOUT_S):
            out, err = await proc.communicate(raw)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise RequestError(503, f"checking the body took over {CHILD_TIMEOUT_S:g} s") from None
    if proc.returncode != 0:
        raise RequestError(500, f"checking the body failed: {err.decode(errors='replace')[-500:]}")
    return await asyncio.to_thread(_assemble, out)


def _check_task_sizes_inline(req: SubmitRequest, max_task_bytes: int) -> None:
    """Inline bodies are at most INLINE_BYTES, so only a cap below that can bind."""
    if max_task_bytes < INLINE_BYTES:
        for i, task in enumerate(req.tasks):
            _check_size(i, len(orjson.dumps(task)), max_task_bytes)


def _check_size(i: int, size: int, cap: int) -> None:
    if size > cap:
        raise RequestError(
            400, f"tasks[{i}] is {size} bytes of JSON; a task may have at most {cap} "
            "(service config max_task_kb): keep big data out of tasks, in files the env reads",
        )  # fmt: skip


def _assemble(out: bytes) -> SubmitRequest:
    """The child's answer back into a request, a task at a time (blocking)."""
    head, _, rest = out.partition(b"\n")
    doc = orjson.loads(head)
    if "error" in doc:
        raise RequestError(400, doc["error"])
    fields = doc["request"]
    tasks: list[dict[str, Any]] = [orjson.loads(line) for line in rest.split(b"\n") if line]
    return SubmitRequest.model_construct(
        _fields_set=set(fields) | {"tasks"},
        **{**fields, "sampling": SamplingConfig.model_validate(fields.get("sampling", {}))},
        tasks=tasks,
    )


def _child(max_task_bytes: int) -> int:
    """`python -m libra.service.intake CAP`: body on stdin; on stdout one line
    `{"request": fields}` then one line per task, or one line `{"error": message}`."""
    raw = sys.stdin.buffer.read()
    out = sys.stdout.buffer
    try:
        req = parse_body(raw, SubmitRequest)
        lines = [orjson.dumps(t) for t in req.tasks]
        for i, line in enumerate(lines):
            _check_size(i, len(line), max_task_bytes)
    except RequestError as e:
        out.write(orjson.dumps({"error": str(e)}) + b"\n")
        return 0
    fields = req.model_dump(mode="json", exclude={"tasks", "sampling"}, exclude_unset=True)
    fields["sampling"] = req.sampling.model_dump(mode="json", include=req.sampling.model_fields_set)
    out.write(orjson.dumps({"request": fields}) + b"\n")
    out.write(b"\n".join(lines) + b"\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(_child(int(sys.argv[1])))


__all__ = ["INLINE_BYTES", "parse_body", "parse_submit"]
