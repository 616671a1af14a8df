"""Sequence packing (`grpo.packing`): several samples in one row give the loss, metrics,
gradients and per-sample log-probs of one padded row per sample, with nothing crossing a
sample boundary; the packed planner keeps to the token budget."""

from __future__ import annotations

import math
import random

import pytest
import torch

from libra.trainer import grpo
from libra.trainer.config import GRPOConfig
from libra.trainer.samples import Sample

NAN = float("nan")


def _llama(folder):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request, tmp_path_factory):
    from libra.trainer.model import load_model
    from tests.integration.test_elastic_helpers import micro_model

    folder = tmp_path_factory.mktemp(request.param) / "m"
    return load_model(micro_model(folder) if request.param == "qwen2" else _llama(folder))


@pytest.fixture(scope="module")
def ref_model(model):
    """A frozen reference that differs from the policy (so the KL term is not zero)."""
    import copy

    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return ref


def fixed_samples() -> list[Sample]:
    """Different lengths and prompt lengths; tool tokens (mask 0) inside responses;
    rollout log-probs partly unknown (nan), wholly unknown (empty) and far below the
    trainer's (TIS capped); mixed advantages."""
    rng = random.Random(5)

    def ids(n: int) -> list[int]:
        return [rng.randrange(256) for _ in range(n)]

    return [
        Sample(ids(9), 3, [1, 1, 0, 0, 1, 1], [-0.5, -1.2, NAN, NAN, -9.5, -0.3], 1.1, 0),
        Sample(ids(4), 1, [1, 1, 1], [-0.1, -0.9, -1.5], -0.7, 0),
        Sample(ids(17), 6, [1] * 3 + [0] * 4 + [1] * 4, [], 0.4, 0),  # rollout unknown
        Sample(ids(2), 1, [1], [NAN], 2.0, 0),  # shortest possible: one token each
        Sample(
            ids(12), 5, [1, 0, 1, 1, 0, 1, 1], [-9.0, NAN, -0.2, -3.0, NAN, -8.0, -1.1], -1.3, 0
        ),
        Sample(ids(7), 2, [1, 1, 1, 0, 1], [-0.4, -0.8, -2.5, NAN, -0.05], 0.0, 0),
    ]


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()])


def _run(model, batch, cfg, **kw) -> tuple[grpo.LocalStats, torch.Tensor]:
    model.zero_grad(set_to_none=False)
    stats = grpo.backward(model, batch, cfg, **kw)
    return stats, _grads(model)


@pytest.mark.parametrize("chunk", [0, 5])
def test_packed_and_padded_give_the_same_loss_metrics_and_gradients(model, ref_model, chunk):
    """Same summed loss, metric sums and gradients (1e-5, float32) with the clip, TIS and
    KL all engaged: a stored `old` from moved weights, a perturbed reference."""
    batch = fixed_samples()
    cfg = GRPOConfig(temperature=0.8, kl_coef=0.1, clip_low=0.05, clip_high=0.05,
                     tis_cap=1.5, micro_batch_tokens=24, logprob_chunk_tokens=chunk)  # fmt: skip
    old = [o + 0.3 * torch.randn_like(o) for o in grpo.old_logprobs(model, batch, cfg)]
    padded, g_padded = _run(model, batch, cfg, old=old, ref_model=ref_model)
    packed_cfg = cfg.model_copy(update={"packing": True})
    packed, g_packed = _run(model, batch, packed_cfg, old=old, ref_model=ref_model)
    assert packed.tokens == padded.tokens == sum(s.tokens for s in batch)
    assert packed.samples == padded.samples == len(batch)
    for k in grpo.METRICS:
        assert packed.metrics[k] == pytest.approx(padded.metrics[k], rel=1e-5, abs=1e-5), k
    for k in ("clipped", "tis_capped", "kl"):
        assert padded.metrics[k] > 0, k  # the comparison exercises each term
    # loss tokens with a known rollout log-prob; none counted across a boundary
    known = [m and not math.isnan(r) for s in batch if s.rollout_logprobs
             for m, r in zip(s.loss_mask, s.rollout_logprobs, strict=True)]  # fmt: skip
    assert packed.metrics["rollout_tokens"] == padded.metrics["rollout_tokens"] == sum(known)
    assert g_padded.norm() > 0
    assert torch.allclose(g_packed, g_padded, rtol=1e-5, atol=1e-5)
    assert (g_packed - g_padded).norm() / g_padded.norm() < 1e-5
    # and with old = current (one update per batch)
    a, ga = _run(model, batch, cfg)
    b, gb = _run(model, batch, packed_cfg)
    assert b.metrics["loss"] == pytest.approx(a.metrics["loss"], rel=1e-5)
    assert (gb - ga).norm() / ga.norm() < 1e-5


@pytest.mark.parametrize("chunk", [0, 5])
def test_old_logprobs_are_the_same_per_sample(model, chunk):
    batch = fixed_samples()
    cfg = GRPOConfig(temperature=0.7, micro_batch_tokens=20, logprob_chunk_tokens=chunk)
    padded = grpo.old_logprobs(model, batch, cfg)
    n = grpo.passes(batch, cfg.model_copy(update={"packing": True}))
    packed = grpo.old_logprobs(model, batch, cfg.model_copy(update={"packing": True}),
                               count=n + 2)  # two dummy passes after the data  # fmt: skip
    for s, a, b in zip(batch, padded, packed, strict=True):
        assert a.shape == b.shape == (s.length - 1,)
        assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()


def test_packed_row_layout_and_boundaries():
    """Position ids restart per sample; the position predicting the next sample's first
    token carries no loss and no rollout log-prob; per-sample slices round-trip."""
    batch = fixed_samples()[:3]
    mb = grpo.pack(batch)
    lengths = [s.length for s in batch]
    assert mb.input_ids.shape == (1, sum(lengths)) and mb.attention_mask is None
    assert mb.position_ids.tolist()[0] == [t for n in lengths for t in range(n)]
    assert mb.offsets == [0, 9, 13]
    for o in (8, 12):  # last position of samples 0 and 1
        assert mb.mask[0, o] == 0 and math.isnan(float(mb.rollout[0, o]))
    assert int(mb.mask.sum()) == sum(s.tokens for s in batch)
    x = torch.arange(1.0, mb.mask.numel() + 1).view_as(mb.mask)
    parts = mb.per_sample(x)
    assert [p.numel() for p in parts] == [n - 1 for n in lengths]
    want = x.clone()
    want[0, [8, 12]] = 0.0  # a boundary belongs to no sample
    assert torch.equal(mb.place(parts), want)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_no_attention_across_samples_in_a_packed_row(model, attn):
    """Changing sample 1's tokens leaves samples 0 and 2's log-probs in the packed row
    unchanged (and equal to each alone, unpadded); the same row read as one sequence
    (no position ids) does see sample 1, so the check would catch a leak."""
    prev = model.config._attn_implementation
    model.set_attn_implementation(attn)
    try:
        batch = fixed_samples()[:3]
        s1 = batch[1]
        other = Sample([(t + 1) % 256 for t in s1.input_ids], s1.prompt_len, s1.loss_mask,
                       s1.rollout_logprobs, s1.advantage, s1.version)  # fmt: skip
        with torch.no_grad():
            base = grpo.pack(batch)
            lp = base.per_sample(grpo.token_logprobs(model, base, 1.0))
            changed = grpo.pack([batch[0], other, batch[2]])
            lp2 = changed.per_sample(grpo.token_logprobs(model, changed, 1.0))
            changed.position_ids = None  # one long causal sequence: sample 2 sees sample 1
            leaky = changed.per_sample(grpo.token_logprobs(model, changed, 1.0))
            alone = [grpo.token_logprobs(model, grpo.collate([s]), 1.0)[0] for s in batch]
        assert torch.equal(lp[0], lp2[0]) and torch.equal(lp[2], lp2[2])
        assert not torch.allclose(lp[1], lp2[1], atol=1e-3)
        assert not torch.allclose(leaky[2], lp[2], atol=1e-3)
        for a, b in zip(lp, alone, strict=True):
            assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()
    finally:
        model.set_attn_implementation(prev)


@pytest.mark.parametrize("seed", range(20))
def test_packed_planner_keeps_to_the_budget(seed):
    """Each packed micro-batch holds at most `budget` tokens unless it is one over-long
    sample; every sample lands in exactly one; no two micro-batches would fit in one
    (first fit), so there are fewer than 2 x tokens / budget + 1."""
    rng = random.Random(seed)
    budget = rng.choice([16, 64, 200])
    samples = [Sample([1] * rng.randint(2, int(budget * 1.5)), 1, [1], [], 0.0, 0)
               for _ in range(rng.randint(1, 60))]  # fmt: skip
    plans = grpo.plan_micro_batches(samples, budget, packing=True)
    assert sorted(i for p in plans for i in p) == list(range(len(samples)))
    for p in plans:
        total = sum(samples[i].length for i in p)
        assert total <= budget or (len(p) == 1 and total > budget)
    over = sum(s.length > budget for s in samples)
    assert sum(len(p) == 1 and samples[p[0]].length > budget for p in plans) == over
    loads = sorted(sum(samples[i].length for i in p) for p in plans)
    assert len(loads) < 2 or loads[0] + loads[1] > budget
    assert len(plans) < 2 * sum(loads) / budget + 1
    cfg = GRPOConfig(micro_batch_tokens=budget, packing=True)
    assert grpo.passes(samples, cfg) == len(plans)
