"""Task rows in the peers' layouts, mapped to an env's own fields. Pure: no I/O.

Two layouts are recognised, both by a `prompt` field:

- **verl** (its RL parquet files): `prompt` is a list of chat messages and
  `reward_model.ground_truth` holds the answer; usually also `data_source` and
  `extra_info.index` (and, in verl's own preprocessing scripts, `extra_info.question`).
- **TRL** (a `GRPOTrainer` dataset): `prompt` is a string or a list of chat messages; the
  answer sits in a column whose name varies: `answer`, `solution` or `ground_truth`.

An env opts in by naming the two fields its `prompt` and `reward` read
(`Env.task_fields = ("question", "answer")`). A row that already has both is left as it
is; a row without `prompt` is the env's own business (left as it is). Otherwise the row
becomes `{id, <question field>, <answer field>, "row": <the original row>}`: the question is
`extra_info.question` when present, else the text of the last user message (or the
prompt string); the env keeps its own system prompt and answer format, so the peer's
instructions around the question are not shown to the model twice. Scalar answers become
strings (the built-in envs compare text); lists and dicts (Search-R1's `{"target": [..]}`)
pass through. The id is `<data_source>-<extra_info.index>` when those indexes are unique
in the file, else the row keeps no id (a content hash names it, `task_id`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from libra.errors import ConfigError

TRL_ANSWERS = ("answer", "solution", "ground_truth")
"""The answer columns a TRL row is searched for, in this order."""

ORIGINAL = "row"
"""The key under which a mapped task keeps the original row (an env's reward may read it)."""


def layout(row: dict[str, Any]) -> str | None:
    """`"verl"`, `"trl"` or None (not a peer layout)."""
    if "prompt" not in row:
        return None
    return "verl" if isinstance(row.get("reward_model"), dict) else "trl"


def _question(row: dict[str, Any], where: str) -> str:
    extra = row.get("extra_info")
    if isinstance(extra, dict) and isinstance(extra.get("question"), str):
        return extra["question"]
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if users and isinstance(users[-1].get("content"), str):
            return str(users[-1]["content"])
    raise ConfigError(
        f"{where}: 'prompt' has no user message with text content; give 'prompt' as a "
        "string or a list of chat messages with a {'role': 'user', 'content': '...'}"
    )


def _answer(row: dict[str, Any], kind: str, where: str, field: str) -> Any:
    if kind == "verl":
        if "ground_truth" not in row["reward_model"]:
            raise ConfigError(
                f"{where}: a verl row needs 'reward_model.ground_truth' (the env's "
                f"{field!r}); it has reward_model keys {sorted(row['reward_model'])}"
            )
        value = row["reward_model"]["ground_truth"]
    else:
        found = [k for k in TRL_ANSWERS if row.get(k) is not None]
        if not found:
            raise ConfigError(
                f"{where}: no answer column for the env's {field!r}: a row with 'prompt' "
                f"needs one of {', '.join(TRL_ANSWERS)} (it has {', '.join(sorted(row))}); "
                "rename the column holding the answer"
            )
        value = row[found[0]]
    return value if isinstance(value, (list, dict)) else str(value)


def _verl_ids(rows: Sequence[dict[str, Any]]) -> list[str | None]:
    ids: list[str | None] = []
    for row in rows:
        extra = row.get("extra_info")
        index = extra.get("index") if isinstance(extra, dict) else None
        ids.append(None if index is None else f"{row.get('data_source') or 'verl'}-{index}")
    named = [i for i in ids if i is not None]
    return ids if len(set(named)) == len(named) else [None] * len(rows)


def adapt_tasks(
    tasks: Sequence[dict[str, Any]], fields: tuple[str, str] | None, *, env: str, source: str
) -> list[dict[str, Any]]:
    """`tasks` with verl / TRL rows mapped to the env's `(question, answer)` fields.

    `fields` None (the env has not opted in, e.g. swe-repair, whose rows describe a bug in
    a project): the rows pass as they are. Raises `ConfigError` naming the row, the
    missing field and the fix.
    """
    if fields is None:
        return list(tasks)
    ids = _verl_ids(tasks)
    out = []
    for i, row in enumerate(tasks):
        kind = layout(row)
        if kind is None or all(f in row for f in fields):
            out.append(row)
            continue
        where = f"{source}: task {i + 1} ({kind} layout, env {env!r})"
        q_field, a_field = fields
        task: dict[str, Any] = {}
        tid = row.get("id", row.get("task_id", ids[i]))
        if tid is not None:
            task["id"] = tid
        task[q_field] = _question(row, where)
        task[a_field] = _answer(row, kind, where, a_field)
        task[ORIGINAL] = row
        out.append(task)
    return out


__all__ = ["ORIGINAL", "TRL_ANSWERS", "adapt_tasks", "layout"]
