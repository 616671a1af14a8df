"""Fitting the cost model's terms to measured step times (`libra.planner.fit`, the pure
half of `libra profile`): the fit recovers an endpoint that behaves like the model, noise
costs about its own size, terms the samples do not show stay at the base profile."""

from __future__ import annotations

import numpy as np
import pytest

from libra.planner import (
    ModelProfile,
    decode_step_time,
    hardware_from_dict,
    hardware_to_dict,
    load_hardware,
    load_model,
    prefill_time,
)
from libra.planner.fit import (
    StepSample,
    TrainSample,
    fit_hardware,
    fit_train_mfu,
    predict_step,
    predict_train,
    with_params,
)
from libra.planner.nelder_mead import nelder_mead

TINY = ModelProfile(
    id="tiny", name="tiny", layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64,
    intermediate=512, vocab=4096,
)  # fmt: skip


def samples(hw, tps=(1,), noise=0.0, seed=0, overhead=2e-3):
    """What `libra profile` would measure on an endpoint that behaves exactly like the
    cost model with `hw` (times a log-normal noise)."""
    rng = np.random.default_rng(seed)
    out = []
    for tp in tps:
        for b in (1, 4, 16, 64):
            for c in (96, 288, 1056):
                s = StepSample(phase="decode", endpoint=f"e{tp}", tp=tp, batch=b, context=c,
                               seconds=1.0)  # fmt: skip
                t = predict_step(TINY, hw, s) * rng.lognormal(0.0, noise)
                out.append(StepSample(phase="decode", endpoint=f"e{tp}", tp=tp, batch=b,
                                      context=c, seconds=t))  # fmt: skip
        for u in (64, 256, 1024, 4096):
            s = StepSample(phase="prefill", endpoint=f"e{tp}", tp=tp, batch=1, context=u,
                           seconds=1.0)  # fmt: skip
            t = (predict_step(TINY, hw, s) + overhead) * rng.lognormal(0.0, noise)
            out.append(StepSample(phase="prefill", endpoint=f"e{tp}", tp=tp, batch=1,
                                  context=u, seconds=t))  # fmt: skip
    return out


def test_nelder_mead_finds_the_minimum_of_a_kinked_function():
    def f(x):
        return float(max(abs(x[0] - 1.0), 2 * abs(x[1] + 2.0)) + (x[2] - 0.5) ** 2)

    x, fx = nelder_mead(f, np.zeros(3))
    assert fx < 1e-6
    assert np.allclose(x, [1.0, -2.0, 0.5], atol=1e-3)


def test_the_fit_recovers_an_endpoint_that_follows_the_cost_model():
    # A datasheet base orders of magnitude off what this "endpoint" achieves.
    base = load_hardware("h100-80g")
    true = with_params(base, 40e9, 80e9, 2.5e-3, base.eff.allreduce_latency_s, seq=150e-6)
    fit = fit_hardware(TINY, base, samples(true))
    assert fit.rms_log_error < 1e-3
    hw = fit.hardware
    assert hw.hbm_bandwidth == base.hbm_bandwidth and hw.flops == base.flops  # peaks kept
    assert hw.hbm_bandwidth * hw.eff.hbm == pytest.approx(40e9, rel=0.01)
    assert hw.flops * hw.eff.prefill_mfu == pytest.approx(80e9, rel=0.01)
    assert hw.eff.step_overhead_s == pytest.approx(2.5e-3, rel=0.01)
    assert hw.eff.seq_overhead_s == pytest.approx(150e-6, rel=0.01)
    assert fit.request_overhead_s["e1"] == pytest.approx(2e-3, rel=0.02)
    assert fit.fitted == ("hbm", "prefill_mfu", "step_overhead_s", "seq_overhead_s")
    # Off the grid, the planner's own functions now predict what the endpoint does.
    for b, ctx in ((8, 700), (32, 150)):
        assert decode_step_time(TINY, hw, 1, b, b * ctx) == pytest.approx(
            decode_step_time(TINY, true, 1, b, b * ctx), rel=0.01
        )
    assert prefill_time(TINY, hw, 1, 2048) == pytest.approx(
        prefill_time(TINY, true, 1, 2048), rel=0.01
    )


def test_noise_costs_the_fit_about_its_own_size():
    base = load_hardware("a800-80g")
    true = with_params(base, 40e9, 80e9, 2.5e-3, base.eff.allreduce_latency_s, seq=50e-6)
    fit = fit_hardware(TINY, base, samples(true, noise=0.05, seed=3))
    assert 0.02 < fit.rms_log_error < 0.08
    for b, ctx in ((8, 700), (32, 150)):
        got = decode_step_time(TINY, fit.hardware, 1, b, b * ctx)
        assert got == pytest.approx(decode_step_time(TINY, true, 1, b, b * ctx), rel=0.1)


def test_tp1_and_tp2_endpoints_pin_the_allreduce_latency():
    base = load_hardware("h100-80g")
    true = with_params(base, 40e9, 80e9, 2.5e-3, 150e-6)
    fit = fit_hardware(TINY, base, samples(true, tps=(1, 2)))
    assert "allreduce_latency_s" in fit.fitted
    assert fit.hardware.eff.allreduce_latency_s == pytest.approx(150e-6, rel=0.05)
    # With one TP size it is not identifiable: the base's value stays.
    only2 = fit_hardware(TINY, base, samples(true, tps=(2,)))
    assert only2.hardware.eff.allreduce_latency_s == base.eff.allreduce_latency_s


def test_a_term_the_samples_do_not_show_stays_near_the_base():
    # Every sample compute-bound: the bandwidth is not pinned and must not run away.
    base = load_hardware("a800-80g")
    true = with_params(base, base.hbm_bandwidth * base.eff.hbm, 20e9, 1e-3, 30e-6)
    fit = fit_hardware(TINY, base, samples(true))
    assert fit.rms_log_error < 1e-3
    assert fit.hardware.eff.hbm == pytest.approx(base.eff.hbm, rel=0.05)


def test_the_per_sequence_overhead_is_paid_per_decoded_sequence_only():
    base = load_hardware("h100-80g")
    assert base.eff.seq_overhead_s == 0.0  # datasheet profiles: as before
    hw = with_params(base, 1e12, 4e14, 2e-3, 40e-6, seq=100e-6)
    plain = with_params(base, 1e12, 4e14, 2e-3, 40e-6)
    m = load_model("qwen3-14b")
    for tp, b in ((1, 1), (1, 64), (4, 32)):
        extra = decode_step_time(m, hw, tp, b, b * 1000) - decode_step_time(
            m, plain, tp, b, b * 1000
        )
        assert extra == pytest.approx(b * 100e-6)
    assert prefill_time(m, hw, 4, 3000, 500) == prefill_time(m, plain, 4, 3000, 500)
    assert hardware_from_dict(hardware_to_dict(hw)).eff.seq_overhead_s == pytest.approx(100e-6)


def test_train_mfu_is_what_the_micro_steps_achieved():
    base = load_hardware("a800-80g")
    hw = with_params(base, 1e9, 1e9, 1e-3, 30e-6)
    target = 0.3
    steps = []
    for n in (256, 1024):
        s = TrainSample(tokens=2 * n, pairs=2 * n * n / 2, seconds=1.0)
        flops = 3 * (s.tokens * TINY.flops_per_token + s.pairs * TINY.attn_flops_per_pair)
        steps.append(
            TrainSample(tokens=s.tokens, pairs=s.pairs, seconds=flops / (base.flops * target))
        )
    mfu = fit_train_mfu(TINY, base.flops, steps)
    assert mfu == pytest.approx(target)
    from dataclasses import replace

    hw = replace(hw, eff=replace(hw.eff, train_mfu=mfu))
    assert predict_train(TINY, hw, steps[0]) == pytest.approx(steps[0].seconds)


def test_a_prefill_sample_is_one_prompt():
    with pytest.raises(ValueError):
        StepSample(phase="prefill", endpoint="e", tp=1, batch=4, context=10, seconds=1.0)
