"""GRPO: advantages, record handling, the per-token loss and its token-level aggregation,
each checked against an independent plain-Python computation."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from libra.record import Trajectory, Turn
from libra.trainer import grpo
from libra.trainer.config import GRPOConfig
from libra.trainer.samples import (
    Sample,
    group_advantages,
    partition,
    policy_version,
    prepare,
    split_minibatches,
)


def rec(gid: str, reward: float, *, status="ok", n=4, step=3, turns=(), mask=None, lps=True):
    mask = mask if mask is not None else [1] * n
    return Trajectory(
        id=f"{gid}-{reward}-{random.random()}", batch_id="b", task_id=gid, group_id=gid,
        env="e", step=step, status=status, reward=reward, prompt_token_ids=[1, 2, 3],
        response_token_ids=list(range(10, 10 + n)), loss_mask=mask,
        logprobs=[-1.0] * n if lps else [],
        turns=[Turn(start=0, model_tokens=n, tool_tokens=0, bucket="b", endpoint="e",
                    policy_version=v) for v in turns],
    )  # fmt: skip


# -- advantages and records -----------------------------------------------------------


def test_group_advantages_match_reference():
    cfg = GRPOConfig()
    for rewards in ([1.0, 0.0, 0.0, 1.0], [0.3, 0.9, 0.1], [2.0, 2.0, 2.0, 5.0, -1.0]):
        mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
        want = [(r - mean) / (std + cfg.adv_eps) for r in rewards]
        assert group_advantages(rewards, cfg) == pytest.approx(want, rel=1e-12)
    none = GRPOConfig(scale_rewards="none")
    assert group_advantages([1.0, 0.0, 0.5], none) == pytest.approx([0.5, -0.5, 0.0])
    assert group_advantages([1.0], cfg) == [0.0]  # no baseline: no signal
    assert group_advantages([1.0, 1.0, 1.0], cfg) == [0.0, 0.0, 0.0]


def test_prepare_status_staleness_and_malformed():
    cfg = GRPOConfig(max_staleness=2)
    records = [
        rec("g", 1.0),
        rec("g", 0.0, status="truncated"),  # kept, with its reward
        rec("g", 0.0, status="error"),
        rec("g", 5.0, status="aborted"),  # dropped, not in the group's statistics
        rec("g", 1.0, turns=(3, 1)),  # oldest turn from version 1: stale at version 4
        rec("h", 1.0, mask=[1, 1]),  # malformed: mask shorter than the response
        rec("h", 0.0, mask=[0, 0, 0, 0]),  # no loss tokens: not trained, still counted
        rec("h", 1.0),
    ]
    p = prepare(records, version=4, cfg=cfg)
    assert p.dropped == {"aborted": 1, "stale": 1, "malformed": 1, "no_tokens": 1}
    # group g's statistics: 1, 0, 0, 1 (the stale one counts; the aborted one does not)
    want = group_advantages([1.0, 0.0, 0.0, 1.0], cfg)
    assert [s.advantage for s in p.samples[:3]] == pytest.approx(want[:3])
    assert len(p.samples) == 4 and p.groups == 2
    assert p.reward_mean == pytest.approx(statistics.fmean([1, 0, 0, 1, 0, 1]))
    assert policy_version(records[4]) == 1 and policy_version(records[0]) == 3


def test_a_reward_beyond_float32_is_dropped_and_its_group_still_trains(model):
    """A record from elsewhere (Libra's scoring refuses such rewards) with a reward of
    1e39 or NaN: dropped as `bad_reward`, out of its group's statistics; before, with
    `scale_rewards = "none"` its advantage did not fit a float32 tensor and the step
    raised, and a NaN reward made its whole group's advantages NaN."""
    cfg = GRPOConfig(scale_rewards="none")
    records = [rec("g", 1e39), rec("g", float("nan")), rec("g", 1.0), rec("g", 0.0)]
    p = prepare(records, version=3, cfg=cfg)
    assert p.dropped == {"bad_reward": 2}
    assert [s.advantage for s in p.samples] == pytest.approx([0.5, -0.5])
    assert p.reward_mean == pytest.approx(0.5)
    model.zero_grad(set_to_none=False)
    stats = grpo.backward(model, p.samples, cfg)
    assert stats.tokens == 8 and torch.isfinite(_grads(model)).all()


def test_partition_balances_and_split_is_round_robin():
    rng = random.Random(0)
    samples = [Sample([1] * rng.randint(5, 60), 2, [1], [], 0.0, 0) for _ in range(40)]
    shares = partition(samples, 3)
    loads = [sum(s.length for s in sh) for sh in shares]
    assert max(loads) - min(loads) <= max(s.length for s in samples)
    assert sorted(id(s) for sh in shares for s in sh) == sorted(map(id, samples))
    assert partition(samples, 3) == shares  # deterministic
    mbs = split_minibatches(samples, 3)
    assert [len(m) for m in mbs] == [14, 13, 13] and mbs[1][0] is samples[1]


# -- the per-token loss ---------------------------------------------------------------


def reference_loss(logp, old, rollout, adv, mask, cfg, ref=None):
    """Plain-Python GRPO loss over tokens (sum, not mean) — independent of the torch code."""
    total = 0.0
    for i in range(len(logp)):
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            ratio = math.exp(logp[i][t] - old[i][t])
            a = adv[i]
            clipped = min(max(ratio, 1 - cfg.clip_low), 1 + cfg.clip_high)
            pg = -min(ratio * a, clipped * a)
            if cfg.rollout_correction == "tis" and not math.isnan(rollout[i][t]):
                pg *= min(math.exp(old[i][t] - rollout[i][t]), cfg.tis_cap)
            kl = 0.0
            if ref is not None:
                d = ref[i][t] - logp[i][t]
                kl = math.exp(d) - d - 1
            total += pg + cfg.kl_coef * kl
    return total


@pytest.mark.parametrize(
    "cfg",
    [
        GRPOConfig(),
        GRPOConfig(clip_high=0.28, kl_coef=0.05),
        GRPOConfig(rollout_correction="none", tis_cap=1.5),
        GRPOConfig(tis_cap=1.2, clip_low=0.1, clip_high=0.1, kl_coef=0.1),
    ],
)
def test_token_loss_matches_reference(cfg):
    g = torch.Generator().manual_seed(1)
    b, t = 3, 7
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.4  # ratio far from 1
    rollout = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.5
    rollout[1, 2:5] = float("nan")  # unknown rollout log-probs: weight 1
    ref = logp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    adv = torch.tensor([[1.3], [-0.7], [0.0]], dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) < 0.7).double()
    total, stats = grpo.token_loss(logp, old, rollout, adv, mask, cfg, ref if cfg.kl_coef else None)
    want = reference_loss(logp.tolist(), old.tolist(), rollout.tolist(), adv[:, 0].tolist(),
                          mask.tolist(), cfg, ref.tolist() if cfg.kl_coef else None)  # fmt: skip
    assert float(total) == pytest.approx(want, rel=1e-12)
    assert stats["loss"] == pytest.approx(want, rel=1e-9)
    ratio = torch.exp(logp - old)
    assert stats["clipped"] > 0  # the test exercises the clip
    assert stats["clipped"] <= float(mask.sum())
    assert ((ratio > 1 + cfg.clip_high) | (ratio < 1 - cfg.clip_low)).any()


def test_token_loss_gradient_at_ratio_one_is_policy_gradient():
    """One update per batch (old = current): d loss / d logp = -w * A on every loss token."""
    cfg = GRPOConfig()
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    rollout = torch.tensor([[-1.5, -2.0, -0.1]], dtype=torch.float64)
    adv = torch.tensor([[0.8]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64)
    total, _ = grpo.token_loss(logp, logp.detach(), rollout, adv, mask, cfg)
    total.backward()
    w = [min(math.exp(-1.0 + 1.5), 2.0), 0.0, min(math.exp(-0.5 + 0.1), 2.0)]
    assert logp.grad[0].tolist() == pytest.approx([-0.8 * w[0], 0.0, -0.8 * w[2]], rel=1e-12)


# -- with a model: alignment and token-level aggregation across replicas --------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from libra.trainer.model import load_model
    from tests.integration.test_elastic_helpers import micro_model

    torch.manual_seed(0)
    return load_model(micro_model(tmp_path_factory.mktemp("m") / "m"))


def samples(n: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, r = rng.randint(1, 6), rng.randint(1, 15)
        mask = [int(rng.random() < 0.7) for _ in range(r)]
        mask[-1] = 1
        out.append(Sample([rng.randrange(256) for _ in range(p + r)], p, mask,
                          [-rng.uniform(0.1, 3) for _ in range(r)], rng.gauss(0, 1), 0))  # fmt: skip
    return out


def test_batched_logprobs_match_per_sample_unpadded(model):
    """Padding, masks and the next-token shift line up: batched = one sample at a time."""
    cfg = GRPOConfig(temperature=0.7)
    batch = samples(5, 1)
    mb = grpo.collate(batch)
    with torch.no_grad():
        lp = grpo.token_logprobs(model, mb, cfg.temperature)
    for i, s in enumerate(batch):
        ids = torch.tensor([s.input_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].double() / cfg.temperature
        ref = torch.log_softmax(logits, -1)
        for j, m in enumerate(s.loss_mask):
            pos = s.prompt_len + j  # the response token's position
            assert mb.mask[i, pos - 1] == m
            want = float(ref[pos - 1, s.input_ids[pos]])
            assert float(lp[i, pos - 1]) == pytest.approx(want, abs=2e-5)
            assert float(mb.rollout[i, pos - 1]) == pytest.approx(s.rollout_logprobs[j])


@pytest.mark.parametrize("chunk", [1, 7, 10_000])
def test_chunked_logprobs_and_their_gradients_equal_whole_logits(model, chunk):
    """The output head chunk by chunk (recomputed in the backward) gives the log-probs
    and the gradients of the whole-logits forward; chunks that do not divide the
    positions, one position, one chunk for all."""
    cfg = GRPOConfig(temperature=0.7, micro_batch_tokens=10_000)
    batch = samples(5, 6)
    mb = grpo.collate(batch)
    with torch.no_grad():
        whole = grpo.token_logprobs(model, mb, cfg.temperature)
        chunked = grpo.token_logprobs(model, mb, cfg.temperature, chunk_tokens=chunk)
    assert torch.allclose(chunked, whole, atol=1e-5, rtol=0), (chunked - whole).abs().max()
    model.zero_grad(set_to_none=False)
    a = grpo.backward(model, batch, cfg.model_copy(update={"logprob_chunk_tokens": 0}))
    g_whole = _grads(model)
    model.zero_grad(set_to_none=False)
    b = grpo.backward(model, batch, cfg.model_copy(update={"logprob_chunk_tokens": chunk}))
    g_chunked = _grads(model)
    assert a.tokens == b.tokens
    assert a.metrics["loss"] == pytest.approx(b.metrics["loss"], rel=1e-5)
    assert g_whole.norm() > 0
    assert (g_chunked - g_whole).norm() / g_whole.norm() < 1e-5


def test_activation_checkpointing_gives_the_same_gradients(tmp_path):
    """Decoder layers recomputed in the backward (`trainer.activation_checkpointing`):
    the same loss and gradients as keeping their activations."""
    from libra.trainer.model import checkpoint_layers, load_model
    from tests.integration.test_elastic_helpers import micro_model

    folder = micro_model(tmp_path / "m", layers=3)
    plain, ckpt = load_model(folder), load_model(folder)
    checkpoint_layers(ckpt)
    on = [
        any(getattr(m, "gradient_checkpointing", False) for m in x.modules()) for x in (plain, ckpt)
    ]
    assert on == [False, True]
    cfg = GRPOConfig(micro_batch_tokens=40)
    batch = samples(6, 8)
    a, b = grpo.backward(plain, batch, cfg), grpo.backward(ckpt, batch, cfg)
    assert a.metrics["loss"] == pytest.approx(b.metrics["loss"], rel=1e-6)
    ga, gb = _grads(plain), _grads(ckpt)
    assert ga.norm() > 0 and (gb - ga).norm() / ga.norm() < 1e-6


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()])


def test_unequal_token_counts_across_replicas_give_the_global_token_mean(model):
    """Two 'replicas' with very different token counts: summing their summed-loss
    gradients and token counts, then dividing once, equals the whole-batch token mean
    (what the all-reduce does); averaging per-replica means does not."""
    cfg = GRPOConfig(micro_batch_tokens=40)  # several micro-batches per replica
    batch = samples(9, 2)
    a, b = batch[:2], batch[2:]
    model.zero_grad(set_to_none=False)
    whole = grpo.backward(model, batch, cfg)
    g_whole = _grads(model) / whole.tokens
    model.zero_grad(set_to_none=False)
    sa = grpo.backward(model, a, cfg)
    ga = _grads(model)
    model.zero_grad(set_to_none=False)
    sb = grpo.backward(model, b, cfg)
    gb = _grads(model)
    assert sa.tokens != sb.tokens and sa.tokens + sb.tokens == whole.tokens
    combined = (ga + gb) / (sa.tokens + sb.tokens)
    assert torch.allclose(combined, g_whole, rtol=1e-5, atol=1e-9)
    assert (combined - g_whole).norm() / g_whole.norm() < 1e-6
    mean_of_means = (ga / sa.tokens + gb / sb.tokens) / 2
    assert (mean_of_means - g_whole).norm() / g_whole.norm() > 1e-2
    # the loss metric aggregates the same way
    total = sa.metrics["loss"] + sb.metrics["loss"]
    assert total / whole.tokens == pytest.approx(whole.metrics["loss"] / whole.tokens, rel=1e-5)


def test_old_logprobs_make_the_ratio_active(model):
    """With a stored `old` (several updates per step) the ratio differs from 1 after the
    weights move, and the clip engages; with old = current it never does."""
    cfg = GRPOConfig(clip_low=0.01, clip_high=0.01)
    batch = samples(4, 3)
    old = grpo.old_logprobs(model, batch, cfg)
    model.zero_grad(set_to_none=False)
    same = grpo.backward(model, batch, cfg, old=old)
    assert same.metrics["clipped"] == 0
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.zero_grad(set_to_none=False)
    moved = grpo.backward(model, batch, cfg, old=old)
    assert moved.metrics["clipped"] > 0
    with torch.no_grad():
        for p, s in zip(model.parameters(), saved, strict=True):
            p.copy_(s)


def test_bfloat16_autocast_matches_float32_gradients(model):
    cfg = GRPOConfig()
    batch = samples(3, 4)
    model.zero_grad(set_to_none=False)
    grpo.backward(model, batch, cfg)
    g32 = _grads(model)
    model.zero_grad(set_to_none=False)
    grpo.backward(model, batch, cfg, dtype="bfloat16")
    g16 = _grads(model)
    assert torch.isfinite(g16).all() and not torch.equal(g16, g32)  # it did run in bf16
    assert (g16 - g32).norm() / g32.norm() < 0.05


def test_replica_update_divides_clips_and_skips_empty_updates(tmp_path):
    from libra.trainer.config import TrainerConfig
    from libra.trainer.replica import Replica, sumsq
    from tests.integration.test_elastic_helpers import micro_model

    folder = micro_model(tmp_path / "m")
    cfg = TrainerConfig(model=str(folder), optim={"lr": 0.1, "warmup_updates": 4,
                                                  "max_grad_norm": 0.5})  # fmt: skip
    r = Replica(cfg)
    flat = torch.randn(r.grad_numel, generator=torch.Generator().manual_seed(0))
    before = r.state_hash()
    assert r.apply(flat, 0, sumsq(flat)) == 0.0  # no tokens anywhere: a no-op update
    assert r.updates == 1 and r.state_hash() != before  # only the count moved
    params = [p.detach().clone() for p in r.params]
    norm = r.apply(flat, 10, sumsq(flat))
    assert norm == pytest.approx(float(flat.norm()) / 10, rel=1e-5)
    assert r.lr_at(2) == pytest.approx(0.05) and r.lr_at(9) == pytest.approx(0.1)
    moved = torch.cat([(p.detach() - q).reshape(-1) for p, q in zip(r.params, params, strict=True)])
    # Adam's first step moves every coordinate by lr * sign-ish(g): |step| <= lr(2) * 1.0
    assert moved.abs().max() <= 0.05 * 1.0001 and moved.abs().max() > 0.04
    # the no-op update counts as an update but not as an Adam step (no bias-correction move)
    assert r.adam_step == 1 and all(float(r.optimizer.state[p]["step"]) == 1 for p in r.params)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_replica_skips_an_update_whose_gradient_is_not_finite(tmp_path, bad):
    """One NaN or infinity in the summed gradient: the update is skipped (weights and
    Adam's moments and step as they were, the update counted, the norm returned for the
    driver to report); the next finite update applies. Before, the NaN reached every
    weight through AdamW (and an infinity, clipped to 0 x inf, likewise)."""
    from libra.trainer.config import TrainerConfig
    from libra.trainer.replica import Replica, sumsq
    from tests.integration.test_elastic_helpers import micro_model

    folder = micro_model(tmp_path / "m")
    r = Replica(TrainerConfig(model=str(folder), optim={"lr": 0.1}))
    flat = torch.randn(r.grad_numel, generator=torch.Generator().manual_seed(0))
    before = [t.clone() for t in r.state_tensors()]
    poisoned = flat.clone()
    poisoned[r.grad_numel // 2] = bad
    norm = r.apply(poisoned, 10, sumsq(poisoned))
    assert not math.isfinite(norm)
    assert all(torch.equal(a, b) for a, b in zip(r.state_tensors(), before, strict=True))
    assert r.updates == 1 and r.adam_step == 0
    assert all(float(g.abs().sum()) == 0 for g, _, _ in r._grads())  # nothing carried over
    assert math.isfinite(r.apply(flat, 10, sumsq(flat)))
    after = r.state_tensors()
    assert all(torch.isfinite(t).all() for t in after) and r.adam_step == 1
    assert not torch.equal(after[0], before[0])
