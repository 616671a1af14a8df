"""Reward functions of the built-in envs on known-good and known-bad answers."""

from __future__ import annotations

from typing import Any

import pytest
from libra.envs.loading import load_records
from libra.envs.math import Math, final_answer
from libra.envs.search_qa import SearchQA, exact_match, f1, gold_answers, normalize

import libra


def traj(answer: str | None, messages: list[dict[str, Any]] | None = None) -> libra.Trajectory:
    t = libra.Trajectory(id="t", batch_id="b", task_id="x", group_id="g", env="e", answer=answer)
    t._messages = messages or []
    return t


# --- search-qa -------------------------------------------------------------------------


def test_normalisation_is_squad_style() -> None:
    assert normalize("The  Lima!") == "lima"
    assert exact_match("the republic of peru.", ["Republic of Peru"]) == 1.0
    assert exact_match("Lima, Peru", ["Lima"]) == 0.0
    assert f1("Lima, Peru", ["Lima"]) == pytest.approx(2 / 3)
    assert gold_answers({"golden_answers": ["a", "b"]}) == ["a", "b"]
    assert gold_answers({"answers": "x"}) == ["x"]


async def test_search_qa_rewards_right_and_wrong_answers() -> None:
    env = SearchQA()
    task = {"id": "q", "question": "What is the capital of Peru?", "answers": ["Lima"]}
    assert (await env.reward(task, traj("Lima")))[0] == 1.0
    assert (await env.reward(task, traj(" lima. ")))[0] == 1.0
    assert (await env.reward(task, traj("Cusco")))[0] == 0.0
    reward, info = await env.reward(task, traj(None))
    assert reward == 0.0 and info["answered"] is False
    f1_env = SearchQA(reward="f1")
    reward, info = await f1_env.reward(task, traj("Lima city"))
    assert reward == pytest.approx(2 / 3) and info["em"] == 0.0


def test_search_qa_rejects_an_unknown_reward() -> None:
    with pytest.raises(libra.LibraError, match="em' or 'f1"):
        SearchQA(reward="bleu")


def test_every_shipped_question_is_answerable_from_the_corpus() -> None:
    env = SearchQA()
    text = " ".join(p["text"] for p in env.corpus.passages)
    for task in load_records(env.default_tasks()):
        assert any(a in text for a in gold_answers(task)), task["id"]


# --- math ------------------------------------------------------------------------------


@pytest.fixture
async def math_env():
    env = Math(workers=1, verify_timeout_s=3)
    yield env
    await env.verifier.aclose()


async def test_math_verifies_equal_forms_and_rejects_wrong_ones(math_env: Math) -> None:
    task = {"id": "m", "question": "Simplify 13524/57134.", "answer": "138/583"}
    assert (await math_env.reward(task, traj("\\frac{138}{583}")))[0] == 1.0
    assert (await math_env.reward(task, traj("138/583")))[0] == 1.0
    assert (await math_env.reward(task, traj("139/583")))[0] == 0.0
    assert (await math_env.reward(task, traj("")))[0] == 0.0
    half = {"id": "h", "question": "?", "answer": "0.5"}
    assert (await math_env.reward(half, traj("$\\frac{1}{2}$")))[0] == 1.0


async def test_math_reads_a_boxed_answer_without_answer_tags(math_env: Math) -> None:
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "so it is \\boxed{\\frac{3}{4}}."},
    ]
    t = traj(None, msgs)
    assert final_answer(t) == "\\frac{3}{4}"
    assert (await math_env.reward({"id": "b", "question": "q", "answer": "0.75"}, t))[0] == 1.0


async def test_math_kills_a_check_that_hangs(math_env: Math) -> None:
    task = {"id": "p", "question": "?", "answer": "1"}
    assert (await math_env.reward(task, traj("1")))[0] == 1.0  # worker started and warm
    reward, _ = await math_env.reward(task, traj("9^9^9^9^9"))
    assert reward == 0.0 and math_env.verifier.killed == 1
    # the pool recovered: the next check gets a fresh worker
    assert (await math_env.reward(task, traj("1")))[0] == 1.0


async def test_math_shipped_references_verify_against_themselves(math_env: Math) -> None:
    tasks = load_records(math_env.default_tasks())
    assert {t["source"].split(":")[0] for t in tasks} == {"champ", "reasoning-gym"}
    for task in tasks[:12]:
        assert (await math_env.reward(task, traj(task["answer"])))[0] == 1.0, task["id"]


def test_arith_calculator_turns_malformed_literals_into_tool_errors() -> None:
    """A model-written "1or 2" is the tool's error, not a SyntaxWarning on stderr (which
    tears `libra train`'s live display)."""
    import warnings

    from libra.envs.arith import calculator

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(libra.errors.ToolError, match="invalid decimal literal"):
            calculator.fn("1or 2")
        assert calculator.fn("(3 + 4) * 12") == "84"
    assert not seen
