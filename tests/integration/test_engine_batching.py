"""The embedded engine's scheduler: continuous batching gives the same tokens as running
each request alone, while requests join and leave the batch (rows move), the KV budget
queues requests, and n choices share one prefill. Real engine thread, no HTTP."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from libra.chat import ChatTokenizer
from libra.engine.core import Choice, EngineCore, Request
from libra.engine.model import Decoder, ModelConfig, load_weights
from libra.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def parts(tiny_model: Path):
    cfg = ModelConfig.load(tiny_model)
    weights = load_weights(tiny_model, cfg)
    chat = ChatTokenizer(tiny_model)
    return cfg, weights, chat


def make_core(parts, **kw) -> EngineCore:
    cfg, weights, chat = parts
    core = EngineCore(Decoder(cfg, weights), chat.tokenizer, frozenset(chat.eos_token_ids), **kw)
    core.start()
    return core


def run_all(
    core: EngineCore, jobs: list[tuple[list[int], list[SamplingParams]]]
) -> list[list[Choice]]:
    results: list[list[Choice] | BaseException | None] = [None] * len(jobs)
    done = threading.Semaphore(0)

    def finisher(i: int):
        def cb(out):
            results[i] = out
            done.release()

        return cb

    for i, (prompt, params) in enumerate(jobs):
        core.submit(Request(id=str(i), prompt=prompt, params=params, on_done=finisher(i)))
    for _ in jobs:
        assert done.acquire(timeout=300)
    assert all(isinstance(r, list) for r in results), results
    return results  # type: ignore[return-value]


def greedy(max_tokens: int, **kw) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0, **kw)
    ]


def test_batched_greedy_equals_each_request_alone(parts):
    jobs = [
        ([(7 * i + j) % 4000 + 5 for j in range(3 + 5 * i)], greedy(4 + 7 * (i % 4)))
        for i in range(10)
    ]
    alone_core = make_core(parts)
    try:
        alone = [run_all(alone_core, [job])[0] for job in jobs]
    finally:
        alone_core.stop()
    batch_core = make_core(parts, max_num_seqs=4)  # forces queueing and row reuse
    try:
        batched = run_all(batch_core, jobs)
    finally:
        batch_core.stop()
    for a, b in zip(alone, batched, strict=True):
        assert a[0].token_ids == b[0].token_ids
        assert a[0].logprobs == pytest.approx(b[0].logprobs, abs=1e-4)
        assert a[0].finish_reason == b[0].finish_reason == "length"


def test_tiny_kv_budget_queues_but_completes(parts):
    core = make_core(parts, kv_cache_bytes=1)  # only one request fits at a time
    try:
        out = run_all(core, [([5, 6, 7], greedy(5)) for _ in range(4)])
    finally:
        core.stop()
    assert len({tuple(o[0].token_ids) for o in out}) == 1
    assert all(len(o[0].token_ids) == 5 for o in out)


def test_n_choices_share_a_prefill_and_seeds_make_them_reproducible(parts):
    params = [
        SamplingParams(max_tokens=12, temperature=1.0, seed=100 + j, ignore_eos=True)
        for j in range(3)
    ]
    core = make_core(parts)
    try:
        first = run_all(core, [([10, 20, 30], params)])[0]
        again = run_all(core, [([10, 20, 30], params)])[0]
    finally:
        core.stop()
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert len({tuple(c.token_ids) for c in first}) == 3  # different seeds, different samples


def test_top_p_tiny_is_greedy_and_logprobs_ignore_temperature(parts):
    core = make_core(parts)
    try:
        [g], [t] = run_all(
            core,
            [
                ([1, 2, 3], greedy(8)),
                ([1, 2, 3], [SamplingParams(max_tokens=8, temperature=1.5, top_p=1e-6,
                                            seed=1, ignore_eos=True, logprobs=0)]),
            ],
        )  # fmt: skip
    finally:
        core.stop()
    assert g.token_ids == t.token_ids
    assert g.logprobs == pytest.approx(t.logprobs, abs=1e-5)


def test_decoder_matches_transformers_logits(parts, tiny_model):
    from transformers import AutoModelForCausalLM

    from libra.engine.model import KVCache

    cfg, weights, _ = parts
    dec = Decoder(cfg, weights)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    cache = KVCache(cfg)
    cache.ensure(2, 32)
    a, b = [5, 6, 7, 8, 9], [11, 12, 13]
    la, lb = dec.prefill(a, cache, 0), dec.prefill(b, cache, 1)
    step = dec.decode([int(la.argmax()), int(lb.argmax())], [len(a), len(b)], cache)
    with torch.no_grad():
        ha = hf(torch.tensor([[*a, int(la.argmax())]])).logits[0]
        hb = hf(torch.tensor([[*b, int(lb.argmax())]])).logits[0]
    assert torch.allclose(la, ha[-2], atol=1e-4) and torch.allclose(lb, hb[-2], atol=1e-4)
    assert torch.allclose(step[0], ha[-1], atol=1e-4) and torch.allclose(step[1], hb[-1], atol=1e-4)


def test_stop_string_across_multibyte_characters(parts):
    _, _, chat = parts
    prompt = chat.encode("Résumé 日本 🚀")
    core = make_core(parts)
    try:
        [[full]] = run_all(core, [(prompt, greedy(10, skip_special_tokens=False))])
        text = full.text
        stop = text[3:5] if len(text) >= 5 else text[-1:]
        [[cut]] = run_all(core, [(prompt, greedy(10, stop=[stop]))])
    finally:
        core.stop()
    assert cut.stop_reason == stop and cut.finish_reason == "stop"
    assert cut.text == text[: text.find(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]


def test_sampler_draws_from_softmax_over_temperature_within_top_p():
    from collections import Counter

    from libra.engine.sampling import Sampler

    sampler = Sampler(seed=7)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 4000
    for temperature, top_p in ((1.0, 1.0), (0.5, 1.0), (1.0, 0.8)):
        p = torch.softmax(logits[0] / temperature, -1)
        if top_p < 1.0:  # nucleus {0, 1}: 0.64 < 0.8 <= 0.64 + 0.24
            p = torch.tensor([p[0], p[1], 0.0, 0.0]) / (p[0] + p[1])
        params = [SamplingParams(temperature=temperature, top_p=top_p)]
        counts = Counter(sampler.sample(logits, params, [None])[0][0] for _ in range(n))
        for tok in range(4):
            assert counts[tok] / n == pytest.approx(float(p[tok]), abs=0.03), (temperature, top_p)


def test_a_swap_lets_every_request_submitted_before_it_finish_on_the_old_weights(parts, tmp_path):
    """vLLM's pause(mode="wait"): requests the engine accepted before a weight swap -
    the running one and those still queued behind it - finish on the old weights; one
    submitted after the swap runs on the new ones. (Queued requests used to start on the
    new weights, so a turn stamped with the version it was sent to could come from the
    next one.)"""
    from libra.engine.model_maker import make_model

    cfg, weights, chat = parts
    newer = load_weights(make_model(tmp_path / "v1", seed=1), cfg)
    prompt, params = [5, 6, 7, 8], greedy(24)
    refs = []
    for w in (weights, newer):
        ref_core = EngineCore(Decoder(cfg, w), chat.tokenizer, frozenset(chat.eos_token_ids))
        ref_core.start()
        try:
            refs.append(run_all(ref_core, [(prompt, params)])[0][0].token_ids)
        finally:
            ref_core.stop()
    old, new = refs
    assert old != new

    core = make_core(parts, max_num_seqs=1)  # one runs, the others queue behind it
    results: dict[str, list[int]] = {}
    done = threading.Semaphore(0)
    swapped = threading.Event()

    def finish(name: str):
        def cb(out):
            results[name] = out[0].token_ids
            done.release()

        return cb

    try:
        for name in ("a", "b", "c"):
            core.submit(Request(id=name, prompt=prompt, params=params, on_done=finish(name)))
        core.swap_weights(newer, swapped.set)
        core.submit(Request(id="d", prompt=prompt, params=params, on_done=finish("d")))
        for _ in range(4):
            assert done.acquire(timeout=300)
        assert swapped.wait(timeout=60)
    finally:
        core.stop()
    assert [results[n] for n in ("a", "b", "c")] == [old, old, old]
    assert results["d"] == new


def test_a_model_that_gives_nan_still_answers_in_json(parts):
    """Weights that overflowed (a diverged policy, published) make every logit NaN. The
    log-probs a response carries are then -9999 (as vLLM's server writes -inf), so the
    response is JSON and the client can read it; before, Python's encoder wrote `NaN`
    and the rollout client failed the turn with 'not a completions response'."""
    import json

    from libra.engine import responses
    from libra.engine.core import LOGPROB_FLOOR

    cfg, weights, chat = parts
    broken = {**weights, "norm": torch.full_like(weights["norm"], float("nan"))}
    core = EngineCore(Decoder(cfg, broken), chat.tokenizer, frozenset(chat.eos_token_ids))
    core.start()
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
        [[c]] = run_all(core, [([1, 2, 3], [params])])
    finally:
        core.stop()
    assert len(c.logprobs or []) == 4 and set(c.logprobs or []) == {LOGPROB_FLOOR}
    assert {v for top in c.top_logprobs or [] for _, v in top} == {LOGPROB_FLOOR}
    body = responses.completion("m", chat.tokenizer, [([1, 2, 3], [c])], return_ids=True)
    json.dumps(body, allow_nan=False)  # strict JSON: raises on NaN or an infinity


def test_a_request_whose_prefill_fails_is_answered_with_the_error(parts) -> None:
    """A prefill that raised (out of memory) left its request out of both lists, so the
    engine's failure handling answered every other request but not it: its client waited
    for ever. The next request is served as before."""
    core = make_core(parts)
    real = core.decoder.prefill
    calls = [0]

    def prefill(*a, **kw):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 1:
            raise MemoryError("no room for the KV cache")
        return real(*a, **kw)

    core.decoder.prefill = prefill  # type: ignore[method-assign]
    got: list[object] = []
    done = threading.Semaphore(0)

    def cb(out: object) -> None:
        got.append(out)
        done.release()

    try:
        core.submit(Request(id="a", prompt=[1, 2, 3], params=greedy(2), on_done=cb))
        assert done.acquire(timeout=60), "never answered"
        assert isinstance(got[0], MemoryError)
        [[choice]] = run_all(core, [([1, 2, 3], greedy(2))])
        assert len(choice.token_ids) == 2
    finally:
        core.stop()
