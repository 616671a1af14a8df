"""The cost model: per-GPU decode bandwidth, KV-head replication, two all-reduces per layer,
KV capacity, training memory and bubble, and agreement with published vLLM measurements."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from libra.errors import ConfigError
from libra.planner import (
    HardwareProfile,
    TrainConfig,
    TrainWorkload,
    best_train,
    decode_step_time,
    instance_cost,
    kv_bytes_per_token_per_gpu,
    kv_capacity_tokens,
    kv_heads_per_gpu,
    load_hardware,
    load_model,
    prefill_time,
    solve_rollout,
    train_memory,
    train_step_time,
)
from libra.planner.validation import decode_checks, decode_table, kv_log_check, uniform_batch

GIB_ = 1024**3
A800 = load_hardware("a800-80g")
H200 = load_hardware("h200-141g")


def quiet(hw: HardwareProfile, **eff: float) -> HardwareProfile:
    """The same hardware with some efficiency fields replaced."""
    return dataclasses.replace(hw, eff=dataclasses.replace(hw.eff, **eff))


# --- profiles -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "total_b", "active_b"),
    [
        ("qwen3-4b", 4.02, 4.02),
        ("qwen3-14b", 14.77, 14.77),
        ("qwen3-32b", 32.76, 32.76),
        ("qwen3-30b-a3b", 30.53, 3.35),
    ],
)
def test_parameter_counts_match_the_published_sizes(name: str, total_b: float, active_b: float):
    # Qwen3 model cards: 4.0B, 14.8B, 32.8B, 30.5B total / 3.3B activated.
    m = load_model(name)
    assert m.params_total / 1e9 == pytest.approx(total_b, abs=0.01)
    assert m.params_active / 1e9 == pytest.approx(active_b, abs=0.01)


def test_a_folder_with_config_json_reads_like_the_builtin_profile(tmp_path):
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_hidden_layers": 40,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "max_position_embeddings": 40960,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    folder, builtin = load_model(str(tmp_path)), load_model("qwen3-14b")
    assert folder.params_total == builtin.params_total
    assert folder.kv_bytes_per_token == builtin.kv_bytes_per_token


def test_unknown_names_list_what_is_known():
    with pytest.raises(ConfigError, match="known: .*a800-80g.*h200-141g"):
        load_hardware("b200")
    with pytest.raises(ConfigError, match="known: .*qwen3-14b"):
        load_model("llama-4")


def test_every_builtin_number_has_a_source():
    for name in ("a800-80g", "h100-80g", "h200-141g", "ascend-910b3"):
        hw = load_hardware(name)
        for key in ("memory_gib", "hbm_tbps", "bf16_tflops", "intra_node_gbps"):
            assert hw.sources.get(key), f"{name}: {key} has no source"
        for key in ("hbm", "comm", "train_mfu", "step_overhead_ms"):
            assert hw.sources.get(f"efficiency.{key}"), f"{name}: efficiency.{key}"


# --- decode ---------------------------------------------------------------------------------
def test_decode_reads_per_gpu_bytes_at_per_gpu_bandwidth():
    """TP t divides the bytes each GPU reads by t, and each GPU reads at its own bandwidth:
    the memory part of a step falls by t, not t^2 (the reference code's mistake)."""
    m = load_model("qwen3-32b")
    hw = quiet(A800, step_overhead_s=0.0, allreduce_latency_s=0.0)
    ic1, ic4 = instance_cost(m, hw, 1), instance_cost(m, hw, 4)
    batch, ctx = 8.0, 8 * 4096.0
    mem1 = float(ic1.weight_read_s(batch)) + ctx * ic1.kv_time_per_token
    mem4 = float(ic4.weight_read_s(batch)) + ctx * ic4.kv_time_per_token
    assert mem1 / mem4 == pytest.approx(4.0, rel=1e-9)
    # Weights alone: 65.5 GB over 2.039 TB/s x 0.9 on one GPU is 35.7 ms.
    assert float(ic1.weight_read_s(1.0)) == pytest.approx(m.weight_bytes / (2.039e12 * 0.9))
    # Whole steps: TP4 is faster than TP1, but by less than 4x (all-reduces), never 16x.
    s1 = decode_step_time(m, A800, 1, 8, 8 * 4096)
    s4 = decode_step_time(m, A800, 4, 8, 8 * 4096)
    assert 1.5 < s1 / s4 < 4.0


def test_kv_heads_shard_up_to_their_count_then_replicate():
    moe = load_model("qwen3-30b-a3b")  # 4 KV heads
    assert [kv_heads_per_gpu(moe, t) for t in (1, 2, 4, 8)] == [4, 2, 1, 1]
    assert kv_bytes_per_token_per_gpu(moe, 8) == kv_bytes_per_token_per_gpu(moe, 4)
    assert kv_bytes_per_token_per_gpu(moe, 2) == 2 * kv_bytes_per_token_per_gpu(moe, 4)
    # So TP8's KV capacity per instance grows less than its extra memory would suggest.
    cap4, cap8 = kv_capacity_tokens(moe, A800, 4), kv_capacity_tokens(moe, A800, 8)
    assert cap8 < 2 * cap4 * 1.3


def test_kv_bytes_match_a_vllm_log():
    """vLLM on 4x H100 logs 178,880 KV tokens in 8.11 GiB for Qwen3-235B-A22B at TP4
    (vllm-project/vllm#21348): one of its 4 KV heads per GPU."""
    assert abs(kv_log_check()["error"]) < 0.02


def test_two_all_reduces_per_layer_per_step():
    m = load_model("qwen3-14b")
    slow = quiet(A800, allreduce_latency_s=1e-3, step_overhead_s=0.0)
    fast = quiet(A800, allreduce_latency_s=0.0, step_overhead_s=0.0)
    for tp in (2, 4, 8):
        extra = decode_step_time(m, slow, tp, 1, 100) - decode_step_time(m, fast, tp, 1, 100)
        assert extra == pytest.approx(2 * m.layers * 1e-3, rel=1e-9)
    assert decode_step_time(m, slow, 1, 1, 100) == decode_step_time(m, fast, 1, 1, 100)


def test_kv_capacity_is_memory_left_after_weights():
    m32 = load_model("qwen3-32b")
    ascend = load_hardware("ascend-910b3")  # 64 GiB: 61 GiB of weights leave no room at TP1
    assert kv_capacity_tokens(m32, ascend, 1) == 0
    assert not instance_cost(m32, ascend, 1).fits
    caps = [kv_capacity_tokens(m32, A800, t) for t in (1, 2, 4, 8)]
    assert caps == sorted(caps) and caps[0] > 0
    # Roughly (0.9 x 80 GiB - 61 GiB - activations) / 256 KiB per token at TP1.
    assert 20_000 < caps[0] < 45_000


def test_prefill_is_compute_bound_for_long_prompts():
    m = load_model("qwen3-14b")
    t = prefill_time(m, A800, 1, 32768)
    flops = 32768 * m.flops_per_token + 32768**2 / 2 * m.attn_flops_per_pair
    assert t == pytest.approx(flops / (A800.flops * A800.eff.prefill_mfu), rel=0.05)


@pytest.mark.parametrize(("what", "predict", "measured", "source"), decode_checks())
def test_decode_agrees_with_published_vllm_measurements(what, predict, measured, source):
    assert predict() == pytest.approx(measured, rel=0.25), f"{what} ({source})"


def test_decode_fit_is_within_fifteen_percent_rms():
    assert decode_table()["rms_log_error"] < 0.15


# --- training -------------------------------------------------------------------------------
WL = TrainWorkload(tokens=4e6, pairs=4e6 * 4000, max_seq=16000, sequences=1024)


def cfg(**kw) -> TrainConfig:
    base = {"tp": 2, "pp": 1, "dp": 8, "micro_batch_tokens": 16384, "zero": 0}
    return TrainConfig(**(base | kw))


def test_zero_stages_shard_memory_in_order():
    m = load_model("qwen3-14b")
    mems = [train_memory(m, A800, cfg(zero=z), WL) for z in (0, 1, 2, 3)]
    assert mems == sorted(mems, reverse=True) and len(set(mems)) == 4
    # ZeRO-1 shards the 12 bytes/param of Adam state over dp = 8.
    per_gpu_params = (m.params_total) / 2
    assert mems[0] - mems[1] == pytest.approx(12 * per_gpu_params * 7 / 8, rel=1e-6)


def test_hybrid_sharding_divides_state_by_the_shard_group_only():
    """HSDP (Libra's replicas: FSDP2 inside a replica of `shard` ranks, replicated across
    replicas) holds the state of ZeRO-3 over `shard` ranks, whatever dp is; its weight
    gathers stay inside the group; shard = dp is plain ZeRO-3."""
    from libra.planner.settings import TrainSettings

    m = load_model("qwen3-14b")
    base: dict = {"tp": 1, "pp": 1, "micro_batch_tokens": 16384, "zero": 3, "recompute": True}
    s = TrainSettings(ref_model=False)
    four = train_memory(m, A800, TrainConfig(dp=4, **base), WL, s)
    hsdp = train_memory(m, A800, TrainConfig(dp=16, shard=4, **base), WL, s)
    full = train_memory(m, A800, TrainConfig(dp=16, **base), WL, s)
    # the same state per GPU as ZeRO-3 over 4 (16 bytes per parameter: bf16 weights
    # and gradients, Adam's 12); activations follow dp's share of the tokens
    states = 16 * m.params_total
    assert hsdp - full == pytest.approx(states / 4 - states / 16, rel=1e-3)
    assert four > hsdp  # dp = 4 ranks each hold 4x the tokens' activations
    assert train_memory(m, A800, TrainConfig(dp=16, shard=16, **base), WL, s) == full
    s = TrainSettings(ref_model=False, logprob_chunk_tokens=1024)
    t_hsdp = train_step_time(m, A800, TrainConfig(dp=16, shard=4, **base), WL, s)
    t_full = train_step_time(m, A800, TrainConfig(dp=16, **base), WL, s)
    assert t_hsdp.fits and t_hsdp.dp_comm_s < t_full.dp_comm_s  # gathers inside a node
    assert not train_step_time(m, A800, TrainConfig(dp=16, shard=3, **base), WL, s).fits


def test_chunked_logprobs_hold_one_chunk_of_logits():
    """A trainer that computes log-probs in chunks (Libra's, `logprob_chunk_tokens`)
    holds one chunk's float32 logits instead of the micro-batch's; a chunk as large as
    the micro-batch changes nothing."""
    from libra.planner.settings import TrainSettings
    from libra.planner.train_cost import micro_batches

    m = load_model("qwen3-14b")
    c = cfg(zero=1)
    _, mb_tok = micro_batches(c, WL, TrainSettings())
    whole = train_memory(m, A800, c, WL)
    chunked = train_memory(m, A800, c, WL, TrainSettings(logprob_chunk_tokens=1024))
    assert whole - chunked == pytest.approx((mb_tok - 1024) * m.vocab * 4 / c.tp)
    same = TrainSettings(logprob_chunk_tokens=c.micro_batch_tokens * 4)
    assert train_memory(m, A800, c, WL, same) == whole


def test_out_of_memory_configurations_do_not_fit():
    m = load_model("qwen3-32b")
    cost = train_step_time(m, A800, cfg(tp=1, dp=1), WL)
    assert not cost.fits and math.isinf(cost.total_s)
    assert train_step_time(m, A800, cfg(tp=8, dp=2, zero=2), WL).fits


def test_recompute_trades_memory_for_time():
    m = load_model("qwen3-4b")
    a, b = (
        train_step_time(m, A800, cfg(zero=2), WL),
        train_step_time(m, A800, cfg(zero=2, recompute=True), WL),
    )
    assert b.memory_bytes < a.memory_bytes and b.compute_s > a.compute_s


def test_one_f_one_b_bubble_is_pp_minus_one_over_micro_batches():
    m = load_model("qwen3-14b")
    c = train_step_time(m, A800, cfg(tp=2, pp=4, dp=2, zero=2, recompute=True), WL)
    assert c.fits
    assert c.bubble_s == pytest.approx(c.compute_s * 3 / c.micro_batches)
    flat = train_step_time(m, A800, cfg(tp=2, pp=1, dp=8, zero=2), WL)
    assert flat.bubble_s == 0.0


def test_divisibility_rules():
    m = load_model("qwen3-30b-a3b")  # 4 KV heads: TP 8 cannot split them for training
    assert not train_step_time(m, A800, cfg(tp=8, dp=2), WL).fits
    assert not train_step_time(m, A800, cfg(tp=2, pp=7, dp=1), WL).fits  # 48 layers
    assert not train_step_time(m, A800, cfg(micro_batch_tokens=8192), WL).fits  # < max_seq


# --- the paper's asymmetry ----------------------------------------------------------------
def test_rollout_is_far_more_length_sensitive_than_training():
    """1K -> 32K tokens per sequence for a fixed GRPO batch on 8 GPUs: rollout slows much
    more than training (the paper: 95x vs 3.9x; docs/cost-model.md#sequence-length)."""
    m = load_model("qwen3-14b")
    ratios = {}
    for length in (1024, 32768):
        stats = uniform_batch(64, 256, length - 256)
        ratios[length] = (
            solve_rollout(m, A800, stats, 8).time_s,
            best_train(m, A800, stats, 8).total_s,
        )
    roll_x = ratios[32768][0] / ratios[1024][0]
    train_x = ratios[32768][1] / ratios[1024][1]
    assert 60 < roll_x < 150  # super-linear: 32x the steps, each reading 32x the KV
    assert 32 < train_x < 70  # near-linear: only attention is quadratic
    assert roll_x > 1.5 * train_x


def test_a_profile_file_is_a_hardware(tmp_path):
    text = (
        'id = "my-gpu"\nmemory_gib = 48\nhbm_tbps = 0.96\nbf16_tflops = 181\n'
        "intra_node_gbps = 32\ninter_node_gbps = 12.5\ndevices_per_node = 4\n"
        "[efficiency]\nhbm = 0.85\n"
    )
    (tmp_path / "my.toml").write_text(text)
    hw = load_hardware(str(tmp_path / "my.toml"))
    assert hw.id == "my-gpu" and hw.devices_per_node == 4 and hw.eff.hbm == 0.85
    assert hw.memory_bytes == 48 * GIB_ and hw.flops == 181e12
    # TP 8 does not fit a 4-device node; TP 4 does.
    m = load_model("qwen3-4b")
    assert not instance_cost(m, hw, 8).fits and instance_cost(m, hw, 4).fits
    (tmp_path / "bad.toml").write_text('id = "x"\nmemory_gib = 48\n')
    with pytest.raises(ConfigError, match="missing key 'hbm_tbps'"):
        load_hardware(str(tmp_path / "bad.toml"))
