"""The trajectory record: the public contract of DESIGN.md, one JSON object per line.

Every stream (in-process queue, NDJSON over HTTP, JSONL files) carries these records.
Extend, never rename. Token-id lists default to empty so that traces without them
(simulator output, `libra eval-routing` inputs) parse with the same model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

EpisodeStatus = Literal["ok", "error", "timeout", "truncated", "aborted"]
ToolStatus = Literal["ok", "error", "timeout"]

ENDPOINT_ERROR = "endpoint: "
"""How a record's `error` starts when an inference endpoint failed the episode."""

REWARD_LIMIT = 1e38
"""The largest reward magnitude a record may carry. The trainer computes in float32
(at most 3.4e38), and an advantage can be the difference of two rewards."""


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)


class ToolCall(_Record):
    name: str
    """Tool name the model asked for ("" when the call could not be parsed)."""
    arguments: dict[str, Any] = Field(default_factory=dict)
    """Parsed JSON arguments."""


class ToolReturn(_Record):
    tool: str
    """Tool name ("" for a malformed call)."""
    status: ToolStatus
    """`ok`; `error` when the tool raised or reported failure (bash/python: non-zero exit);
    `timeout` when it ran out of time."""
    payload_tokens: int
    """Tokens of the tool response as appended to the context."""
    latency_s: float
    """Wall time of the call."""
    info: dict[str, Any] | None = None
    """What the tool reported beside its text (`ToolResult.info`), e.g. a sandboxed
    command's exit code and which limit acted (`oom_killed`, `flooded`, `timed_out`)."""


class Turn(_Record):
    start: int
    """Offset of this turn's first model token in `response_token_ids`."""
    model_tokens: int
    """Tokens the model generated this turn (loss mask 1)."""
    tool_tokens: int
    """Tokens appended after the turn (tool responses + template, loss mask 0)."""
    bucket: str
    """Bucket that served the turn."""
    endpoint: str
    """Base URL of the endpoint that served the turn."""
    policy_version: int
    """Weights version loaded on that endpoint when the turn was sent."""
    finish_reason: str | None = None
    """`stop` / `length` / `abort` as the endpoint reported, or null."""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_returns: list[ToolReturn] = Field(default_factory=list)


class Migration(_Record):
    turn: int
    """Index of the first turn served by the new bucket."""
    from_bucket: str
    to_bucket: str
    reprefill_tokens: int
    """Context tokens the new bucket has to prefill."""
    reason: str
    """Why: the policy's explanation (predictions, costs), `overflow`, or `endpoint-down`."""


class Segment(_Record):
    """A further segment of an agent episode (the OpenAI-compatible proxy): the agent
    edited its history (dropped or rewrote a message, changed the tools), so its next
    request no longer extended the tokens so far and the episode went on from a freshly
    rendered prompt. A segment stands alone: train on its `prompt_token_ids` +
    `response_token_ids` exactly as on a record's own."""

    turn: int
    """Index in `turns` of its first turn; the turns up to the next segment's `turn` are
    its own, and their `start` offsets index its `response_token_ids`."""
    reason: str
    """What the agent changed, e.g. `message 3 (assistant) rewritten`, `tools changed`."""
    prompt_token_ids: list[int] = Field(default_factory=list)
    """The edited conversation, rendered whole (model tokens in it have no loss)."""
    prompt_tokens: int = 0
    response_token_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)


class Timings(_Record):
    queued_s: float = 0.0
    """Waiting for admission and endpoint capacity."""
    generate_s: float = 0.0
    """Inside LLM calls."""
    tool_s: float = 0.0
    """Inside tool calls."""
    total_s: float = 0.0
    """From admission to finish."""


class Trajectory(_Record):
    """One finished episode. `libra.Trajectory` is this model."""

    id: str
    batch_id: str
    task_id: str
    """The prompt id C-MLFQ keys on."""
    group_id: str
    """Ties the G samples of one task."""
    env: str
    step: int = 0
    """Policy version (training step) that started the episode."""
    seq: int = 0
    """Position in its batch's stream (for resuming a stream)."""
    status: EpisodeStatus = "ok"
    reward: float = 0.0
    reward_info: dict[str, Any] | None = None
    answer: str | None = None
    """Text of the final `<answer>`, or null."""
    error: str | None = None
    """For a status other than `ok`: what went wrong, in one line."""
    prompt_token_ids: list[int] = Field(default_factory=list)
    prompt_tokens: int = 0
    response_token_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    total_tokens: int = 0
    """prompt + model + tool tokens: the final context length."""
    turns: list[Turn] = Field(default_factory=list)
    migrations: list[Migration] = Field(default_factory=list)
    timings: Timings = Field(default_factory=Timings)
    segments: list[Segment] = Field(default_factory=list)
    """Further segments after history edits (agent episodes only; empty when every
    request extended the conversation). The token fields above hold the first segment;
    `total_tokens` is the final context length, the last segment's."""

    # Not serialised: the conversation as text, for reward functions that need it.
    _messages: list[dict[str, Any]] = PrivateAttr(default_factory=list)

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages (opening prompt, model turns, tool returns)."""
        return self._messages

    @property
    def model_tokens(self) -> int:
        return sum(t.model_tokens for t in self.turns)

    def to_json(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json"))

    def unwritable(self, e: Exception) -> Trajectory:
        """The `error` record that stands in for this one when it cannot be written
        (`to_json` raised: lists and objects nested deeper than pydantic and orjson
        write, about 254 levels), so that its episode is still accounted for."""
        return Trajectory(
            id=self.id, batch_id=self.batch_id, task_id=self.task_id, group_id=self.group_id,
            env=self.env, step=self.step, seq=self.seq, status="error",
            error=f"the episode's record could not be written ({e}); its turns and tokens "
            "are dropped",
        )  # fmt: skip

    @classmethod
    def from_json(cls, data: bytes | str) -> Trajectory:
        return cls.model_validate(orjson.loads(data))


def read_jsonl(path: str | Path) -> list[Trajectory]:
    """Read a JSONL file of records (`.gz`: gzip-compressed, as `libra workload` writes
    them); raises ValueError naming the first bad line and, for a record that does not
    validate, its first problem on one line."""
    import gzip

    out: list[Trajectory] = []
    opener: Any = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    out.append(Trajectory.from_json(line))
                except ValidationError as e:
                    first = e.errors()[0]
                    where = ".".join(str(x) for x in first["loc"]) or "(the record)"
                    raise ValueError(f"{path}:{lineno}: not a trajectory record: {where}: "
                                     f"{first['msg']}") from None  # fmt: skip
                except Exception as e:
                    raise ValueError(f"{path}:{lineno}: not a trajectory record: {e}") from None
    except (EOFError, OSError) as e:  # a cut or broken gzip file
        raise ValueError(f"{path}: cannot be read whole ({e})") from None
    return out


def json_schema() -> dict[str, Any]:
    """The JSON schema of the record, as checked in at `libra/trajectory.schema.json`."""
    return Trajectory.model_json_schema()


__all__ = [
    "ENDPOINT_ERROR",
    "REWARD_LIMIT",
    "EpisodeStatus",
    "Migration",
    "Segment",
    "Timings",
    "ToolCall",
    "ToolReturn",
    "ToolStatus",
    "Trajectory",
    "Turn",
    "json_schema",
    "read_jsonl",
]


if __name__ == "__main__":  # regenerate the checked-in schema
    import json as _json

    print(_json.dumps(json_schema(), indent=2))
