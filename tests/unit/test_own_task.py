"""Each episode gets its own copy of its task (an env that wrote to `ctx.task` changed
what the group's other episodes saw): the task's JSON read back, or `deepcopy` where
that would not be equal (a tuple, a NaN), large tasks on a worker thread."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from libra.chat import ChatTokenizer
from libra.rollout.inputs import own_task
from libra.rollout.offload import Offload


@pytest.mark.parametrize("size", [10, 100_000])  # inline, and on a worker thread
async def test_an_episode_owns_an_equal_copy_of_its_task(tiny_model: Path, size: int) -> None:
    offload = Offload(ChatTokenizer(tiny_model))
    task = {"id": "t", "question": "x" * size, "answer": [1, 2.5, None, {"a": True}]}
    mine = await own_task(task, offload)
    assert mine == task
    mine["answer"][3]["a"] = False
    mine["question"] += "!"
    assert task["answer"][3] == {"a": True} and task["question"] == "x" * size
    odd = {"id": "t", "pair": (1, 2), "score": math.nan, "big": 2**70}
    copy = await own_task(odd, offload)
    assert copy["pair"] == (1, 2) and math.isnan(copy["score"]) and copy["big"] == 2**70
    assert copy is not odd
