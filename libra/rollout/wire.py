"""What crosses between the front process and its rollout workers (`libra.rollout.workers`,
`libra.rollout.worker`): framed messages over one local stream socket, and a finished
record as its worker serialised it.

A frame is two big-endian u32 lengths, a JSON header (orjson) and an optional raw blob:
a record's JSON travels as the blob, so the front never parses it. The front only
splices the record's `seq` in (`RawRecord.to_json`): a worker serialises with `seq` 0
and says where that 0 is.

With the record come two small summaries, so that the front needs none of its payload:
`facts` (what `/metrics` and `libra rollout`'s summary count) and `lesson` (what a
routing policy learns from: `libra.routing.records.FinishedEpisode`'s fields), which
the front forwards to the other workers so that every worker's policy learns from every
finished episode, as one process's would.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from libra.record import Trajectory

log = logging.getLogger(__name__)

_LENGTHS = struct.Struct(">II")
MAX_HEADER = 64 << 20
"""Largest header accepted (a header carries a task inline; tasks are capped far lower)."""
SEQ_FIELD = b',"seq":0,'
"""The seq field of a record serialised with seq 0. Every field before it is a scalar
(id, batch_id, task_id, group_id, env, step) and a JSON string cannot hold an unescaped
quote, so its first occurrence is the record's own."""


class WireError(Exception):
    """The peer sent something that is not a frame (or the stream ended inside one)."""


def frame(header: dict[str, Any], blob: bytes = b"") -> bytes:
    head = orjson.dumps(header)
    return _LENGTHS.pack(len(head), len(blob)) + head + blob


async def read_frame(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes] | None:
    """The next frame, or None at a clean end of stream (between frames)."""
    try:
        prefix = await reader.readexactly(_LENGTHS.size)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise WireError("the stream ended inside a frame") from None
        return None
    n_head, n_blob = _LENGTHS.unpack(prefix)
    if n_head > MAX_HEADER:
        raise WireError(f"a header of {n_head} bytes: not a libra worker stream")
    try:
        head = await reader.readexactly(n_head)
        blob = await reader.readexactly(n_blob) if n_blob else b""
    except asyncio.IncompleteReadError:
        raise WireError("the stream ended inside a frame") from None
    return orjson.loads(head), blob


# --- records ---------------------------------------------------------------------------
Facts = tuple[str, int, int, float, list[str], int, dict[str, int]]
"""(status, model_tokens, total_tokens, reward, migration reasons, tool calls, tool
returns not `ok` by status)."""


def facts_of(r: Trajectory) -> Facts:
    errors: dict[str, int] = {}
    calls = 0
    for t in r.turns:
        calls += len(t.tool_returns)
        for tr in t.tool_returns:
            if tr.status != "ok":
                errors[tr.status] = errors.get(tr.status, 0) + 1
    reasons = [m.reason for m in r.migrations]
    return (r.status, r.model_tokens, r.total_tokens, r.reward, reasons, calls, errors)


def lesson_of(r: Trajectory) -> list[Any]:
    """A `FinishedEpisode` as plain values (`Lesson` reads it back)."""
    turns = []
    for t in r.turns:
        returns = [[x.tool, x.status, x.payload_tokens] for x in t.tool_returns]
        turns.append([t.model_tokens, t.tool_tokens, returns])
    return [r.task_id, r.step, r.prompt_tokens, r.total_tokens, r.status, turns]


@dataclass(frozen=True, slots=True)
class _Return:
    tool: str
    status: str
    payload_tokens: int


@dataclass(frozen=True, slots=True)
class _Turn:
    model_tokens: int
    tool_tokens: int
    tool_returns: tuple[_Return, ...]


@dataclass(frozen=True, slots=True)
class Lesson:
    """A finished episode as a routing policy reads it (`FinishedEpisode`), rebuilt from
    `lesson_of`'s values in another worker."""

    task_id: str
    step: int
    prompt_tokens: int
    total_tokens: int
    status: str
    turns: tuple[_Turn, ...]

    @classmethod
    def of(cls, v: Sequence[Any]) -> Lesson:
        turns = tuple(_Turn(m, t, tuple(_Return(*x) for x in rs)) for m, t, rs in v[5])
        return cls(v[0], v[1], v[2], v[3], v[4], turns)


@dataclass(eq=False, slots=True)
class RawRecord:
    """A finished record as its worker serialised it: enough to spool, stream and count
    it (`Spool.extend`, `Metrics.add`, `Stats.add` take it beside a `Trajectory`)."""

    id: str
    group_id: str
    status: str
    blob: bytes
    """The record's JSON with `seq` 0."""
    at: int
    """Offset of that 0 in `blob`."""
    facts: Facts
    seq: int = 0

    def to_json(self) -> bytes:
        view = memoryview(self.blob)
        return b"".join((view[: self.at], b"%d" % self.seq, view[self.at + 1 :]))


def serialized(record: Trajectory | RawRecord) -> tuple[Trajectory | RawRecord, bytes]:
    """(the record written, its JSON): a record that cannot be written gives way to its
    `Trajectory.unwritable` stand-in (a `RawRecord` is JSON already)."""
    try:
        return record, record.to_json()
    except (TypeError, ValueError) as e:  # orjson, or pydantic, refused it
        assert isinstance(record, Trajectory)
        log.error("episode %s: its record cannot be written (%s); an error record stands in",
                  record.id, e)  # fmt: skip
        stand_in = record.unwritable(e)
        return stand_in, stand_in.to_json()


def pack_record(r: Trajectory) -> tuple[dict[str, Any], bytes]:
    """(header fields, blob) of a finished record, for `unpack_record` in the front."""
    r.seq = 0
    written, blob = serialized(r)
    assert isinstance(written, Trajectory)
    r = written
    at = blob.find(SEQ_FIELD)
    if at < 0:  # the record model changed shape: fail loudly, not with a wrong seq
        raise AssertionError("a record without its seq field after the scalar ids")
    head = {"id": r.id, "group_id": r.group_id, "status": r.status, "facts": facts_of(r),
            "at": at + len(SEQ_FIELD) - 2}  # fmt: skip
    return head, blob


def unpack_record(head: dict[str, Any], blob: bytes) -> RawRecord:
    f = head["facts"]
    facts: Facts = (f[0], f[1], f[2], f[3], f[4], f[5], f[6])
    return RawRecord(head["id"], head["group_id"], head["status"], blob, head["at"], facts)


__all__ = [
    "Facts",
    "Lesson",
    "RawRecord",
    "WireError",
    "facts_of",
    "frame",
    "lesson_of",
    "pack_record",
    "read_frame",
    "serialized",
    "unpack_record",
]
