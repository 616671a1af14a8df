"""`report.wandb = true`: the per-step metrics in an offline Weights & Biases run whose files
sit in the run folder. Skipped without the `wandb` extra (CI installs it)."""

from __future__ import annotations

import json
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from libra.errors import ConfigError
from libra.train.report import Report
from tests.conftest import IN_CI

ROWS = [
    {"step": 1, "reward_mean": 0.25, "tokens_per_s": 120.5, "roles": {"rollout": 2, "train": 1}},
    {"step": 2, "reward_mean": 0.5, "tokens_per_s": 130.0, "roles": {"rollout": 1, "train": 2}},
]


def records(run_file: Path) -> Iterator[bytes]:
    """The records of a `.wandb` file: LevelDB's log format (32 KiB blocks; each chunk a
    4-byte checksum, 2-byte length, 1-byte type: 1 full, 2 first, 3 middle, 4 last) after
    a 7-byte header."""
    data, pos, parts = run_file.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header: padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if pos + 7 + length > len(data):  # a chunk still being written
            return
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield parts
            parts = b""


def history(run_file: Path) -> list[dict[str, object]]:
    """The rows logged to a `.wandb` file, decoded with wandb's own protobuf messages."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for data in records(run_file):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in rec.history.item})  # fmt: skip
    return rows


def test_offline_wandb_run_in_the_run_folder(tmp_path: Path, monkeypatch) -> None:
    if not IN_CI:  # CI installs the extra: there a missing wandb fails
        pytest.importorskip("wandb", reason="the wandb extra is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    report = Report(tmp_path, wandb={"steps": 2, "data": {"env": "arith"}})
    for row in ROWS:
        report.step(row)
    report.close()
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    # wandb's service process writes the file: under load its last records can land
    # just after `finish` returned (seen in CI: the file then held no history yet)
    deadline = time.monotonic() + 60
    while len(rows := [r for r in history(run_file) if "reward_mean" in r]) < len(ROWS):
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [(r["_step"], r["reward_mean"], r["tokens_per_s"], r["roles/train"]) for r in rows] == [
        (1, 0.25, 120.5, 1),
        (2, 0.5, 130.0, 2),
    ]
    assert (tmp_path / "wandb-run-id").read_text().strip() in run_file.name


def test_wandb_missing_is_one_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'libra-rl\[wandb\]'"):
        Report(tmp_path, wandb={})
