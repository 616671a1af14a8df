"""The warm start runs in a trainer process of its own (`libra.trainer.sft.warm_start`):
progress comes back to the caller's thread, the folder it writes loads, and a stop
request ends it with KeyboardInterrupt and leaves no process behind."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import threading
from pathlib import Path

import pytest
import torch

from libra.record import Trajectory
from libra.trainer.model import load_model
from libra.trainer.sft import SFTProgress, warm_start


def demos(n: int = 8) -> list[Trajectory]:
    """Agentic-looking demonstrations: one shared prompt prefix (the system prompt), a
    short task, a response with a tool-output span that carries no loss."""
    rng = random.Random(0)
    system = [rng.randrange(16, 4000) for _ in range(12)]
    out = []
    for i in range(n):
        task = [rng.randrange(16, 4000) for _ in range(4)]
        response = [rng.randrange(16, 4000) for _ in range(10)]
        mask = [1] * 4 + [0] * 3 + [1] * 3
        record = Trajectory(
            id=f"d{i}", batch_id="demos", task_id=f"t{i}", group_id=f"t{i}", env="test",
            prompt_token_ids=system + task, response_token_ids=response, loss_mask=mask,
            reward=1.0,
        )  # fmt: skip
        out.append(record)
    return out


def children() -> list[int]:
    """Processes whose parent is this one, zombies included (Linux /proc), but not
    multiprocessing's resource tracker (started once with the first spawned process,
    it lives as long as this one)."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:  # it exited while we looked
                continue
            # "pid (comm) state ppid ...": comm may hold spaces, so split after ')'
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == me and b"resource_tracker" not in cmdline:
                found.append(int(entry))
    return found


def test_warm_start_trains_in_its_own_process(tiny_model: Path, tmp_path: Path):
    seen: list[tuple[SFTProgress, int]] = []
    before = children()
    res = warm_start(
        tiny_model, demos(), tmp_path / "sft", steps=3, batch=4, lr=1e-3, target=None,
        seed=0, on_progress=lambda p: seen.append((p, threading.get_ident())),
    )  # fmt: skip
    assert res.pid != os.getpid() and res.pid > 0  # trained elsewhere ...
    assert [p.step for p, _ in seen] == [1, 2, 3]  # ... reporting every step
    assert {t for _, t in seen} == {threading.get_ident()}  # in the caller's thread
    assert (res.steps, res.stopped) == (3, "steps") and res.path == str(tmp_path / "sft")
    assert children() == before and not mp.active_children()  # and it is gone
    trained, base = load_model(res.path), load_model(tiny_model)
    moved = [
        not torch.equal(a, b)
        for a, b in zip(trained.state_dict().values(), base.state_dict().values(), strict=True)
    ]
    assert any(moved)


def test_should_stop_interrupts_and_leaves_no_process(tiny_model: Path, tmp_path: Path):
    seen: list[SFTProgress] = []
    before = children()
    with pytest.raises(KeyboardInterrupt):
        warm_start(
            tiny_model, demos(), tmp_path / "sft", steps=10_000, batch=4, lr=1e-3,
            target=None, seed=0, on_progress=seen.append, should_stop=lambda: len(seen) >= 2,
        )  # fmt: skip
    assert 2 <= len(seen) < 10_000
    assert children() == before and not mp.active_children()
    assert not (tmp_path / "sft").exists()  # stopped before writing anything


def test_a_failure_in_the_process_is_raised_in_the_caller(tmp_path: Path):
    from libra.errors import ModelError

    with pytest.raises(ModelError, match="not a model folder"):
        warm_start(
            tmp_path / "missing", demos(), tmp_path / "sft", steps=1, batch=1, lr=1e-3,
            target=None, seed=0,
        )  # fmt: skip
    assert not mp.active_children()
