"""`libra train` whose core training replica dies between two steps, while a hybrid in
training holds the same state: the run stops in one line, but its checkpoint is saved
from the hybrid at the step of the loss (no periodic checkpoint was due), which is
where the same command resumes (real engines, the real trainer)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import orjson
import pytest

from libra.trainer.checkpoint import read_meta
from tests.integration.test_train_engine_loss import CONFIG, rows, start_train

RUN = (
    CONFIG.replace("steps = 4", "steps = 30")
    .replace(
        "core_rollout = 2\nhybrids = 0", 'core_rollout = 1\nhybrids = 1\nhybrid_start = "train"'
    )
    .replace("concurrency = 16", "concurrency = 16\nmax_staleness = 0")
    .replace("plots = false", "plots = false\ncheckpoint_every = 100")
)


def rank_pid(parent: int, name: str) -> int:
    """The trainer rank process `name` (`libra-core0-0`) among `parent`'s children."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            comm = Path(f"/proc/{d}/comm").read_text().strip()
            ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if comm == name and ppid == parent:
            return int(d)
    raise AssertionError(f"no process {name} under {parent}")


@pytest.mark.timeout(600)
def test_a_core_replica_lost_between_steps_is_saved_from_the_hybrid(tmp_path: Path) -> None:
    proc, out, log = start_train(tmp_path, RUN)
    try:
        deadline = time.monotonic() + 300
        joined_at = None
        while True:  # a step wholly trained with the hybrid in
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the hybrid never joined"
            events = rows(out / "events.jsonl") if (out / "events.jsonl").is_file() else []
            joined = [e for e in events if e["event"] == "trainer-joined"]
            done = len(rows(out / "metrics.jsonl")) if (out / "metrics.jsonl").is_file() else 0
            if joined and joined_at is None:
                joined_at = done
            if joined_at is not None and done > joined_at:
                break
            time.sleep(0.05)
        # the step's row is written after its publication; with no staleness the next
        # batch only starts rolling out now, so the trainer waits for it
        os.kill(rank_pid(proc.pid, "libra-core0-0"), signal.SIGKILL)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code != 0, text[-3000:]
    [line] = [x for x in text.splitlines() if x.startswith("libra: error:")]
    assert "core replica core0" in line, line
    assert f"resumes from its checkpoint at step {done} (saved from hybrid" in line, line
    assert int(orjson.loads((out / "state.json").read_bytes())["version"]) == done
    assert read_meta(out / "checkpoint")["version"] == done
    failed = [e for e in rows(out / "events.jsonl") if e["event"] == "trainer-failed"]
    assert len(failed) == 1 and failed[0]["checkpoint_step"] == done, failed
    assert failed[0]["saved_from"].startswith("hybrid"), failed
