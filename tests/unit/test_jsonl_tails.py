"""JSON-lines files Libra appends to (a rollout's records, a run's trajectories and
metrics) after a write that did not finish (a full disk, a crash mid-write): the torn
last line is cut off before anything is appended, and a resume reads the rest. Before,
the next record was glued to the fragment and a resume stopped on it with
`orjson.JSONDecodeError`."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from libra.errors import ConfigError
from libra.record import Trajectory, read_jsonl
from libra.rollout.sink import TAIL_BLOCK, JsonlSink, whole_lines
from libra.train.report import set_aside_groups


def rec(group: int, k: int) -> Trajectory:
    return Trajectory(id=f"g{group:06d}/{k}", batch_id="b", task_id=f"t{group}",
                      group_id=f"g{group:06d}", env="arith")  # fmt: skip


@pytest.mark.parametrize(
    ("content", "kept"),
    [
        (b"", b""),
        (b'{"a": 1}\n', b'{"a": 1}\n'),
        (b'{"a": 1}\n{"b": 2}\n{"c"', b'{"a": 1}\n{"b": 2}\n'),
        (b'{"torn', b""),
        (b'{"a": 1}\n' + b"x" * (3 * TAIL_BLOCK + 5), b'{"a": 1}\n'),  # longer than a block
        (b"y" * (2 * TAIL_BLOCK) + b"\n" + b"z" * 7, b"y" * (2 * TAIL_BLOCK) + b"\n"),
    ],
)
def test_whole_lines_cuts_only_a_torn_tail(tmp_path: Path, content: bytes, kept: bytes) -> None:
    path = tmp_path / "f.jsonl"
    path.write_bytes(content)
    assert whole_lines(path) == len(content) - len(kept)
    assert path.read_bytes() == kept
    assert whole_lines(tmp_path / "absent.jsonl") == 0


def test_a_sink_appends_whole_records_after_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    sink = JsonlSink(path)
    sink(rec(0, 0))
    sink.close()
    with open(path, "ab") as f:
        f.write(rec(0, 1).to_json()[:25])  # the disk took part of the next record
    sink = JsonlSink(path)
    sink(rec(0, 1))
    sink.close()
    assert [r.id for r in read_jsonl(path)] == ["g000000/0", "g000000/1"]


def test_a_resume_sets_aside_groups_past_a_torn_line_and_names_a_bad_one(tmp_path: Path):
    path = tmp_path / "trajectories.jsonl"
    path.write_bytes(b"".join(rec(g, 0).to_json() + b"\n" for g in range(4)) + b'{"id": "g0')
    assert set_aside_groups(path, 2) == 2
    assert [r.id for r in read_jsonl(path)] == ["g000000/0", "g000001/0"]
    path.write_bytes(rec(0, 0).to_json() + b"\nnot json\n" + rec(1, 0).to_json() + b"\n")
    with pytest.raises(ConfigError, match=r"trajectories.jsonl:2: not a trajectory record"):
        set_aside_groups(path, 1)
    assert orjson.loads(path.read_bytes().splitlines()[0])["id"] == "g000000/0"  # untouched
