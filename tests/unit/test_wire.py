"""What crosses between the front and its rollout workers (#22): a record spliced with
its seq is byte for byte the record serialised with that seq; a lesson teaches a
routing policy what the record would; frames round-trip and a torn one is an error."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from libra.record import Migration, Trajectory
from libra.rollout.wire import (
    Lesson,
    WireError,
    facts_of,
    frame,
    lesson_of,
    pack_record,
    read_frame,
    unpack_record,
)
from libra.service.metrics import Metrics
from tests.unit.test_cmlfq import at_first_return, long_after_error, policy, short_after_ok


def tricky() -> Trajectory:
    rec = long_after_error(task='q,"seq":0,"x')
    rec.migrations = [
        Migration(turn=1, from_bucket="tp2", to_bucket="tp4", reprefill_tokens=9, reason="overflow")
    ]
    rec.id = 'id,"seq":0,'
    rec.reward = 0.5
    return rec


@pytest.mark.parametrize("seq", [0, 7, 12345])
def test_a_spliced_record_is_the_record_with_its_seq(seq: int) -> None:
    rec = tricky()
    head, blob = pack_record(rec)
    raw = unpack_record(orjson.loads(orjson.dumps(head)), blob)
    raw.seq = seq
    rec.seq = seq
    assert raw.to_json() == rec.to_json()
    assert (raw.id, raw.group_id, raw.status) == (rec.id, rec.group_id, rec.status)


def test_metrics_count_a_raw_record_as_the_record() -> None:
    rec = tricky()
    a, b = Metrics(), Metrics()
    a.add(rec)
    b.add(unpack_record(*pack_record(rec)))
    assert vars(a) == vars(b)
    assert facts_of(rec)[4] == ["overflow"]


def test_a_lesson_teaches_what_the_record_does() -> None:
    direct, relayed = policy(), policy()
    records = [long_after_error() for _ in range(4)] + [short_after_ok() for _ in range(4)]
    for r in records:
        direct.on_finish(r)
        relayed.on_finish(Lesson.of(orjson.loads(orjson.dumps(lesson_of(r)))))
    direct.end_step(0)
    relayed.end_step(0)
    assert relayed.tree.to_bytes() == direct.tree.to_bytes()
    for status in ("ok", "error"):
        state = at_first_return(status)
        assert relayed.on_tool_return(state) == direct.on_tool_return(state)


async def test_frames_round_trip_and_a_torn_frame_is_an_error() -> None:
    data = frame({"op": "run", "e": 1}) + frame({"op": "done"}, b"blob")
    reader = asyncio.StreamReader()
    reader.feed_data(data + data[:5])
    reader.feed_eof()
    assert await read_frame(reader) == ({"op": "run", "e": 1}, b"")
    assert await read_frame(reader) == ({"op": "done"}, b"blob")
    with pytest.raises(WireError):
        await read_frame(reader)
    clean = asyncio.StreamReader()
    clean.feed_eof()
    assert await read_frame(clean) is None


def test_a_worker_packs_an_error_record_for_one_it_cannot_write() -> None:
    """A rollout worker serialises its finished records for the front; one nested deeper
    than pydantic and orjson write (about 254 levels) raised there and killed the
    worker, then the two after it that ran the episode again. Now the worker packs the
    episode's `error` record instead."""
    from libra.record import Trajectory
    from libra.rollout.wire import pack_record, unpack_record

    deep: object = 1
    for _ in range(300):
        deep = [deep]
    bad = Trajectory(id="b/t/0", batch_id="b", task_id="t", group_id="b/t", env="arith",
                     response_token_ids=[1, 2], reward_info={"trace": deep})  # fmt: skip
    head, blob = pack_record(bad)
    raw = unpack_record(head, blob)
    raw.seq = 7
    back = Trajectory.from_json(raw.to_json())
    assert (back.id, back.seq, back.status, raw.status) == ("b/t/0", 7, "error", "error")
    assert "record could not be written" in (back.error or "") and not back.response_token_ids
