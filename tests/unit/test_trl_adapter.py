"""`libra.integrations.trl`'s pure parts: prompts grouped as TRL repeats them, rows found
by prompt, a record flattened into one TRL completion (or refused with the reason)."""

from __future__ import annotations

import pytest

from libra.integrations.trl import RolloutError, completion, index_rows, libra_reward, runs
from libra.record import Segment, Trajectory


def record(**kw: object) -> Trajectory:
    base = {"id": "b/t/0", "batch_id": "b", "task_id": "t", "group_id": "g", "env": "arith",
            "prompt_token_ids": [1, 2, 3], "prompt_tokens": 3,
            "response_token_ids": [10, 11, 20, 21, 12], "loss_mask": [1, 1, 0, 0, 1],
            "logprobs": [-0.5, -0.25, 0.0, 0.0, -1.0], "reward": 0.75}  # fmt: skip
    return Trajectory.model_validate(base | kw)


def test_runs_of_equal_prompts_become_groups_in_order() -> None:
    a, b = [{"role": "user", "content": "a"}], "b"
    assert runs([a, a, a, b, b, a]) == [(a, 0, 3), (b, 3, 2), (a, 5, 1)]
    assert runs([]) == []


def test_a_multi_turn_record_is_one_completion_with_tool_tokens_masked() -> None:
    c = completion(record(), filler=0)
    assert c.prompt_ids == [1, 2, 3]
    assert c.completion_ids == [10, 11, 20, 21, 12]
    assert c.env_mask == [1, 1, 0, 0, 1]
    assert c.logprobs == [-0.5, -0.25, 0.0, 0.0, -1.0]
    assert c.reward == 0.75


def test_a_failed_episode_has_no_reward_and_a_masked_filler() -> None:
    c = completion(record(status="error", error="endpoint down", response_token_ids=[],
                          loss_mask=[], logprobs=[], prompt_token_ids=[]), filler=7)  # fmt: skip
    assert c.reward is None  # TRL gives an all-None row no advantage
    assert (c.prompt_ids, c.completion_ids, c.env_mask, c.logprobs) == ([7], [7], [0], [0.0])
    assert completion(record(status="truncated"), filler=0).reward == 0.75


def test_an_edited_history_is_refused_with_its_reason() -> None:
    segs = [Segment(turn=3, reason="message 3 (assistant) rewritten")]
    with pytest.raises(RolloutError, match=r"2 segments; turn 3: message 3 .*libra train"):
        completion(record(segments=segs), filler=0)


def test_misaligned_record_is_refused() -> None:
    with pytest.raises(RolloutError, match="5 response tokens but 4 log-probs"):
        completion(record(logprobs=[0.0] * 4), filler=0)


def test_rows_are_found_by_prompt_and_conflicts_refused() -> None:
    p = [{"role": "user", "content": "What is 2 + 2?"}]
    rows = index_rows([{"prompt": p, "answer": "4"}, {"prompt": p, "answer": "4"}])
    assert list(rows.values()) == [{"prompt": p, "answer": "4"}]
    with pytest.raises(RolloutError, match="differ"):
        index_rows([{"prompt": p, "answer": "4"}, {"prompt": p, "answer": "5"}])
    with pytest.raises(RolloutError, match="no 'prompt' column"):
        index_rows([{"question": "q"}])


def test_libra_reward_passes_the_episode_rewards_through() -> None:
    assert libra_reward(["x", "y"], libra_reward=[1.0, None]) == [1.0, None]
    with pytest.raises(RolloutError, match="rollout_func=LibraRollout"):
        libra_reward(["x"])
