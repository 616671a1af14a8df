"""A profiling run as a profile file, a JSON document and a short text report.

The file is a hardware profile in the layout of `libra/planner/data/hardware/*.toml`
(`load_hardware` reads it), with a `[sources]` line for every number saying whether it
was measured (what, where, when, how) or kept from the base profile, and a `[profile]`
table the planner does not read: every sample, the fit and the held-out checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from libra.planner import hardware_to_dict
from libra.planner.fit import StepSample, memory_bound, predict_step, predict_train
from libra.profiling import tomlfile
from libra.profiling.probe import Timing
from libra.profiling.session import ProfileResult

METHOD = (
    "decode: one prompt with n = batch choices, ignore_eos, timed at max_tokens 1 and N; "
    "(fast t_N - fast t_1) / (N - 1) is one step at a mean context of prompt + N/2; "
    "prefill: a fresh prompt, max_tokens 1, its request time = the step + a fixed cost per "
    "request (fitted per endpoint); fast = the first quartile of many requests, in rounds "
    "over the whole grid (contention only adds time); fit: least "
    "squares of log(predicted / measured) over the cost model's decode_step_time / "
    "prefill_time (libra.planner.fit)"
)

HEADER = """\
Hardware profile measured by `libra profile` (docs/cost-model.md, "Measured profiles").
Use it with `libra plan --hardware FILE`, `libra simulate --hardware FILE`, or
`[planner] hardware = "FILE"` in a `libra train` config. The planner reads the fields
above [profile]; [profile] records what was measured and how well the fit predicts it."""


def _base_source(r: ProfileResult, key: str) -> str:
    return f"base {r.base.id}: {r.base.sources.get(key, 'the base profile (no source given)')}"


def _bound_note(r: ProfileResult, memory: bool) -> str:
    fitted = [m.sample for m in r.steps if not m.held_out]
    n = sum(memory_bound(r.model, r.fit.hardware, s) == memory for s in fitted)
    side = "memory" if memory else "compute"
    if n == 0:
        return (
            f"no measured step was {side}-bound, so the measurements do not pin it: the fit "
            f"kept it near the base's value"
        )
    return f"{side}-bound in {n} of {len(fitted)} fitted samples"


def profile_sources(r: ProfileResult) -> dict[str, str]:
    eff, when = r.fit.hardware.eff, f"{r.created} on {r.host}"
    eps = ", ".join(f"{e.bucket}={e.url} ({e.kind}, TP {e.tp})" for e in r.endpoints)
    fitted = f"fitted by `libra profile` {when} to the step times of {eps}"
    bw = r.fit.hardware.hbm_bandwidth * eff.hbm / 1e9
    fl = r.fit.hardware.flops * eff.prefill_mfu / 1e9
    src = {k: _base_source(r, k) for k in ("memory_gib", "intra_node_gbps", "inter_node_gbps")}
    src["devices_per_node"] = _base_source(r, "devices_per_node")
    src["hbm_tbps"] = _base_source(r, "hbm_tbps") + " (peak kept; efficiency.hbm is fitted)"
    src["bf16_tflops"] = (
        _base_source(r, "bf16_tflops") + " (peak kept; the MFUs are measured against it)"
    )
    src["efficiency.hbm"] = f"{fitted}: {bw:.3g} GB/s effective; {_bound_note(r, True)}"
    src["efficiency.prefill_mfu"] = f"{fitted}: {fl:.3g} GFLOP/s effective; {_bound_note(r, False)}"
    src["efficiency.step_overhead_ms"] = f"{fitted}: the fixed time of an engine step"
    src["efficiency.seq_overhead_us"] = (
        f"{fitted}: the time a decode step spends per sequence beyond the model's FLOPs "
        "and bytes (sampling, bookkeeping)"
    )
    if "allreduce_latency_s" in r.fit.fitted:
        src["efficiency.allreduce_latency_us"] = f"{fitted}: TP 1 and TP > 1 endpoints"
    else:
        src["efficiency.allreduce_latency_us"] = (
            _base_source(r, "efficiency.allreduce_latency_us")
            + " (not fitted: it needs endpoints of TP 1 and of TP > 1)"
        )
    for k in ("efficiency.comm", "efficiency.p2p_latency_us"):
        src[k] = _base_source(r, k)
    if r.train:
        shapes = ", ".join(f"{t.sequences}x{t.length}" for t, _ in r.train)
        src["efficiency.train_mfu"] = (
            f"{r.train_note} {r.created}: forward + backward of {r.model_spec} over "
            f"{shapes} tokens, 3 x the cost model's forward FLOPs / fastest time / peak"
        )
    else:
        src["efficiency.train_mfu"] = (
            _base_source(r, "efficiency.train_mfu") + f" (trainer micro-step {r.train_note})"
        )
    src["profile"] = (
        f"`libra profile` {when}: model {r.model_spec}; endpoints {eps}; {METHOD}; "
        f"rms log error of the fit {r.fit.rms_log_error:.3f}; held-out checks in [profile]"
    )
    return src


def _step_row(r: ProfileResult, s: StepSample, t: Timing, held: bool) -> dict[str, Any]:
    predicted = predict_step(r.model, r.hardware, s)
    step = r.fit.step_seconds(s)
    return {
        "phase": s.phase,
        "endpoint": s.endpoint,
        "tp": s.tp,
        "batch": s.batch,
        "context": s.context,
        "held_out": held,
        "measured_ms": s.seconds * 1e3,
        "step_ms": step * 1e3,
        "predicted_ms": predicted * 1e3,
        "error": predicted / step - 1.0 if step > 0 else float("inf"),
        "requests_ms": [x * 1e3 for x in t.short],
        **({"long_requests_ms": [x * 1e3 for x in t.long]} if t.long else {}),
    }


def document(r: ProfileResult) -> dict[str, Any]:
    """The profile file's content (also the `--json` document)."""
    from libra.planner.fit import TrainSample

    steps = [_step_row(r, m.sample, m.timing, m.held_out) for m in r.steps]
    train = []
    for t, held in r.train:
        s = TrainSample(tokens=t.tokens, pairs=t.pairs, seconds=t.seconds)
        predicted = predict_train(r.model, r.hardware, s)
        train.append(
            {
                "sequences": t.sequences,
                "length": t.length,
                "held_out": held,
                "measured_s": t.seconds,
                "predicted_s": predicted,
                "error": predicted / t.seconds - 1.0,
                "repeats_s": list(t.repeats),
            }
        )
    cfg = r.config
    b, c = cfg.held_out_point
    return {
        **hardware_to_dict(r.hardware),
        "profile": {
            "created": r.created,
            "host": r.host,
            "model": r.model_spec,
            "base": r.base.id,
            "method": METHOD,
            "wall_s": r.wall_s,
            "train_step": r.train_note,
            "grid": {
                "batches": cfg.batches,
                "contexts": cfg.contexts,
                "decode_tokens": cfg.decode_tokens,
                "repeats": cfg.repeats,
                "held_out": [b, c],
                "train_lengths": cfg.train_lengths,
                "train_sequences": cfg.train_sequences,
            },
            "fit": {
                "fitted": list(r.fit.fitted) + (["train_mfu"] if r.train else []),
                "rms_log_error": r.fit.rms_log_error,
                "request_overhead_ms": {k: v * 1e3 for k, v in r.fit.request_overhead_s.items()},
            },
            "held_out": [row for row in steps + train if row["held_out"]],
            "endpoints": [
                {
                    "bucket": e.bucket,
                    "url": e.url,
                    "kind": e.kind,
                    "tp": e.tp,
                    "served_model": e.served_model,
                }
                for e in r.endpoints
            ],
            "steps": steps,
            "train": train,
        },
    }


def write(r: ProfileResult, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(tomlfile.dumps(document(r), HEADER))
    tmp.replace(p)
    return p


def render(r: ProfileResult, doc: dict[str, Any], path: Path) -> str:
    hw, eff = r.hardware, r.hardware.eff
    fitted = [row for row in doc["profile"]["steps"] if not row["held_out"]]
    lines = [
        f"profile {hw.id}: {r.model_spec} on {len(r.endpoints)} endpoint(s), "
        f"{len(fitted)} fitted samples, rms log error {r.fit.rms_log_error:.1%}",
        f"  effective bandwidth {hw.hbm_bandwidth * eff.hbm / 1e9:.3g} GB/s "
        f"(hbm {eff.hbm:.3g} of {hw.hbm_bandwidth / 1e12:.3g} TB/s), inference "
        f"{hw.flops * eff.prefill_mfu / 1e9:.3g} GFLOP/s (prefill_mfu {eff.prefill_mfu:.3g}), "
        f"step overhead {eff.step_overhead_s * 1e3:.3g} ms + {eff.seq_overhead_s * 1e6:.3g} us "
        "per sequence",
        f"  train_mfu {eff.train_mfu:.3g}: {r.train_note or 'kept from the base'}",
        "  held out (measured, not fitted):",
    ]
    for row in doc["profile"]["held_out"]:
        if "phase" in row:
            what = (
                f"decode batch {row['batch']} context {row['context']:g}"
                if row["phase"] == "decode"
                else f"prefill {row['context']:g} tokens"
            )
            lines.append(
                f"    TP {row['tp']} {what}: measured {row['step_ms']:.3g} ms, "
                f"predicted {row['predicted_ms']:.3g} ms ({row['error']:+.1%})"
            )
        else:
            lines.append(
                f"    trainer micro-step {row['sequences']}x{row['length']}: measured "
                f"{row['measured_s']:.3g} s, predicted {row['predicted_s']:.3g} s "
                f"({row['error']:+.1%})"
            )
    lines.append(
        f"  wrote {path}: use it with `libra plan --hardware {path}` or "
        f'`[planner] hardware = "{path}"`'
    )
    return "\n".join(lines)


__all__ = ["HEADER", "METHOD", "document", "profile_sources", "render", "write"]
