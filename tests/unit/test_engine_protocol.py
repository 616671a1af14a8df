"""The embedded engine's request checks (`libra.engine.protocol`), as vLLM's server
answers them: a bad field is a 400 naming it."""

from __future__ import annotations

import pytest

from libra.engine import protocol


def test_n_past_the_engine_s_max_num_seqs_is_a_400() -> None:
    """`n = 1,000,000` was admitted when nothing else ran and allocated its KV cache
    whole, past `--kv-cache-gib`: the prefill failed and its client waited for ever."""
    limits = protocol.Limits("m", context=128, vocab_size=100, max_n=4)
    body = {"prompt": "hi", "temperature": 1.0}
    assert len(protocol.sampling({**body, "n": 4}, 3, limits, default_max=8, chat=False)) == 4
    with pytest.raises(protocol.ApiError) as err:
        protocol.sampling({**body, "n": 1_000_000}, 3, limits, default_max=8, chat=False)
    assert err.value.status == 400 and "n must be at most 4" in str(err.value)
