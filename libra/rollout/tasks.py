"""Tasks in, episode specs out: `.jsonl` / `.json` / `.parquet` files of JSON objects."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

from libra.errors import ConfigError
from libra.rollout.episode import EpisodeSpec


def load_tasks(path: str | Path, limit: int = 0) -> list[dict[str, Any]]:
    """Read tasks; every task must be a JSON object. Task ids must be unique."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"tasks file {str(p)!r} not found")
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        tasks = _read_jsonl(p)
    elif suffix == ".json":
        try:
            doc = orjson.loads(p.read_bytes())
        except orjson.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from None
        if not isinstance(doc, list) or not all(isinstance(t, dict) for t in doc):
            raise ConfigError(f"{p}: expected a JSON list of task objects")
        tasks = doc
    elif suffix == ".parquet":
        tasks = _read_parquet(p)
    else:
        raise ConfigError(f"tasks file {str(p)!r}: unsupported type; use .jsonl, .json or .parquet")
    if limit:
        tasks = tasks[:limit]
    if not tasks:
        raise ConfigError(f"tasks file {str(p)!r} holds no tasks")
    unique_ids(tasks, str(p))
    return tasks


def repeated_id(tasks: Sequence[dict[str, Any]]) -> tuple[int, int, str] | None:
    """(index, index of the earlier task, id) of the first task whose id an earlier one
    has (their episodes would share ids and a group), or None."""
    seen: dict[str, int] = {}
    for i, t in enumerate(tasks):
        tid = task_id(t)
        if tid in seen:
            return i, seen[tid], tid
        seen[tid] = i
    return None


def unique_ids(tasks: Sequence[dict[str, Any]], source: str) -> None:
    """Raises `ConfigError` naming the first task whose id an earlier one has. Run again
    once verl / TRL rows are mapped (`libra.rollout.layouts.adapt_tasks`): a mapped row's
    id can be another row's."""
    if (twin := repeated_id(tasks)) is not None:
        i, first, tid = twin
        raise ConfigError(f"{source}: task {i + 1} repeats the id {tid!r} of task "
                          f"{first + 1}; task ids must be unique")  # fmt: skip


def given_tasks(tasks: Any, source: str) -> list[dict[str, Any]]:
    """Tasks handed over in Python (`rollout(config, tasks=...)`) checked as a file's
    are: a non-empty list of JSON objects with unique ids."""
    if not isinstance(tasks, Sequence) or isinstance(tasks, str | bytes) or not tasks:
        raise ConfigError(f"{source}: expected a non-empty list of task dicts")
    for i, t in enumerate(tasks, 1):
        if not isinstance(t, dict):
            raise ConfigError(f"{source}: task {i} is a {type(t).__name__}, not a dict")
        try:
            orjson.dumps(t)
        except TypeError as e:
            raise ConfigError(f"{source}: task {i} is not JSON ({e}); tasks are stored and "
                              "sent as JSON objects") from None  # fmt: skip
    unique_ids(tasks, source)
    return list(tasks)


def _read_jsonl(p: Path) -> list[dict[str, Any]]:
    tasks = []
    with open(p, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                raise ConfigError(f"{p}:{lineno}: not valid JSON ({e})") from None
            if not isinstance(obj, dict):
                raise ConfigError(f"{p}:{lineno}: a task must be a JSON object")
            tasks.append(obj)
    return tasks


def _read_parquet(p: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - pyarrow comes with `datasets`
        raise ConfigError("reading .parquet tasks needs pyarrow (pip install pyarrow)") from None
    try:
        return list(pq.read_table(p).to_pylist())
    except Exception as e:
        raise ConfigError(f"{p}: cannot read parquet ({e})") from None


def task_id(task: dict[str, Any]) -> str:
    """The prompt id C-MLFQ keys on: the task's `id` (or `task_id`), else a content hash
    (stable across runs)."""
    for key in ("id", "task_id"):
        if task.get(key) is not None:
            return str(task[key])
    digest = hashlib.sha1(orjson.dumps(task, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return f"t-{digest[:12]}"


def episode_specs(
    tasks: Sequence[dict[str, Any]], group_size: int, batch_id: str, step: int = 0
) -> Iterator[EpisodeSpec]:
    """G episodes per task; `group_id` ties them; ids are `batch/task/k`."""
    for ti, task in enumerate(tasks):
        tid = task_id(task)
        group = f"{batch_id}/{tid}"
        for k in range(group_size):
            yield EpisodeSpec(
                id=f"{group}/{k}",
                batch_id=batch_id,
                task_id=tid,
                group_id=group,
                task=task,
                index=ti * group_size + k,
                step=step,
            )


__all__ = ["episode_specs", "given_tasks", "load_tasks", "task_id", "unique_ids"]
