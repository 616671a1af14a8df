"""Reward and tool `info` on the record (`libra.rollout.reward.plain`): JSON-safe, and
at most `MAX_INFO_BYTES` of it: values are kept in order while they fit, the rest are a
note naming their size."""

from __future__ import annotations

import orjson

from libra.rollout.reward import MAX_INFO_BYTES, plain


def test_info_keeps_what_fits_in_order_and_notes_the_rest():
    half = "y" * (MAX_INFO_BYTES // 2)
    info = {"a": 1, "big": half, "bigger": half + half, "b": [1, 2], "also": half}
    out = plain(info)
    assert out is not None
    assert out["a"] == 1 and out["big"] == half and out["b"] == [1, 2]
    assert out["bigger"] == (
        f"<a str of {MAX_INFO_BYTES + 2:,} bytes as JSON, not kept: info keeps {MAX_INFO_BYTES:,}>"
    )
    assert out["also"].startswith("<a str of")  # half fits no more beside the first half
    assert len(orjson.dumps(out)) <= MAX_INFO_BYTES + 200
    small = {"score": 0.5, "parts": {"f1": 0.4}}
    assert plain(small) == small


def test_a_reward_is_a_number_not_text() -> None:
    """`float("1.0")` made a str reward count; a reward function returning text has a bug."""
    import pytest

    from libra.rollout.reward import BadReward, as_reward

    for text in ("1.0", b"1", bytearray(b"1")):
        with pytest.raises(BadReward, match="return a float"):
            as_reward(text)
    assert as_reward(1) == (1.0, None) and as_reward((0.5, {"n": 1})) == (0.5, {"n": 1})
