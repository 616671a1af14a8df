"""`Env.parse_answer`'s default, `last_answer`: the last `<answer>` pair as
`ANSWER_RE.findall` finds it, without the regex's quadratic time on unclosed tags (it
runs on the event loop at every model turn)."""

from __future__ import annotations

import random

import pytest

from libra.env import ANSWER_RE, Env, last_answer

PIECES = ["<answer>", "</answer>", "<answer", "answer>", "</", "a", " 42 ", "\n", "<", ">"]


def by_regex(text: str) -> str | None:
    found = ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


def test_the_last_answer_is_the_regex_s_on_any_mix_of_tags():
    rng = random.Random(0)
    for _ in range(5000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randrange(0, 24)))
        assert last_answer(text) == by_regex(text), text
    assert last_answer("<answer>a<answer>b</answer> c <answer> d </answer>") == "d"
    assert last_answer("<answer>a<answer>b</answer>") == "a<answer>b"  # as findall pairs them
    assert last_answer("<answer>open") is None and last_answer("") is None


@pytest.mark.timeout(60)  # the regex takes minutes here; the scan, milliseconds
def test_a_turn_of_unclosed_answer_tags_does_not_hold_the_loop():
    """A degenerate policy writing `<answer>` over and over: 400,000 characters took
    the regex about 100 s of the event loop (10 s at 128,000)."""
    text = "<answer>" * 50_000
    assert Env().parse_answer(text) is None
    assert Env().parse_answer(text + "x</answer>") == "<answer>" * 49_999 + "x"
