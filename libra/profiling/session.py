"""One profiling run: describe the endpoints, time them, time a trainer micro-step, fit.

    result = run_profile(cfg, progress=print)
    result.hardware        # the fitted HardwareProfile (what the written file loads as)

Endpoints are timed one after another (endpoints on one machine would otherwise slow
each other down), grid point by grid point, the held-out point among them; then the
trainer micro-step runs in its own process. The fit (`libra.planner.fit`) sees every
sample but the held-out ones.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from libra.errors import ConfigError, EndpointError, ModelError
from libra.planner import HardwareProfile, ModelProfile, calibrate_local, load_hardware, load_model
from libra.planner.fit import HardwareFit, StepSample, TrainSample, fit_hardware, fit_train_mfu
from libra.profiling import trainstep
from libra.profiling.config import ProfileConfig
from libra.profiling.probe import DecodePoint, Endpoint, Prober, Timing, describe, measure_grid


@dataclass(frozen=True, slots=True, kw_only=True)
class Measured:
    sample: StepSample
    timing: Timing
    held_out: bool


@dataclass(kw_only=True)
class ProfileResult:
    config: ProfileConfig
    endpoints: list[Endpoint]
    model_spec: str
    model: ModelProfile
    base: HardwareProfile
    fit: HardwareFit
    hardware: HardwareProfile
    """The written profile: the fit, `train_mfu` from the micro-step, id, name, sources."""
    steps: list[Measured]
    train: list[tuple[trainstep.TrainTiming, bool]] = field(default_factory=list)
    """Micro-step timings, each with its held-out flag."""
    train_note: str = ""
    """How `train_mfu` was obtained, or why the micro-step was skipped."""
    train_info: dict[str, Any] = field(default_factory=dict)
    created: str = ""
    host: str = ""
    wall_s: float = 0.0


async def describe_all(cfg: ProfileConfig) -> list[Endpoint]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        return [await describe(session, e.bucket, e.url, e.tp, cfg.kind) for e in cfg.endpoints]


def resolve_model(cfg: ProfileConfig, endpoints: list[Endpoint]) -> tuple[str, ModelProfile]:
    if cfg.model:
        return cfg.model, load_model(cfg.model)
    roots = sorted({e.root for e in endpoints})
    if len(roots) > 1:
        raise ConfigError(
            f"the endpoints serve different models ({', '.join(roots)}); a profile is fitted "
            "for one model: profile them separately, or name it with --model"
        )
    if not (Path(roots[0]) / "config.json").is_file():
        raise ConfigError(
            f"the endpoints serve {roots[0]!r}, which is not a model folder on this machine; "
            "pass --model (a folder with config.json, or a known id such as qwen3-14b)"
        )
    return roots[0], load_model(roots[0])


def resolve_base(cfg: ProfileConfig, model: ModelProfile) -> HardwareProfile:
    if cfg.base != "local":
        return load_hardware(cfg.base)
    return calibrate_local(
        devices=cfg.devices or os.cpu_count() or 1,
        hidden=model.hidden,
        intermediate=model.intermediate or None,
    )


async def measure_endpoints(
    cfg: ProfileConfig,
    endpoints: list[Endpoint],
    model: ModelProfile,
    progress: Callable[[str], None],
    clock: Callable[[], float],
) -> list[Measured]:
    held_b, held_c = cfg.held_out_point
    n = cfg.decode_tokens
    out: list[Measured] = []
    timeout = aiohttp.ClientTimeout(total=900, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for ep in endpoints:
            if ep.max_model_len is not None and cfg.longest > ep.max_model_len:
                raise ConfigError(
                    f"{ep.url} serves {ep.max_model_len} tokens of context; the grid needs "
                    f"{cfg.longest} (context + decode tokens): use smaller --context values"
                )
            probe = Prober(session, ep, vocab=model.vocab, seed=cfg.seed, clock=clock)
            progress(f"{ep.bucket} {ep.url} ({ep.kind}, TP {ep.tp}): warming up")
            await probe.warm_up(max(*cfg.batches, held_b), max(*cfg.contexts, held_c), n)
            points = [(b, c, False) for b in cfg.batches for c in cfg.contexts]
            points.insert(len(points) // 2, (held_b, held_c, True))
            fills = [(c, False) for c in cfg.contexts] + [(held_c, True)]
            decode, prefill = await measure_grid(
                probe,
                [DecodePoint(b, c) for b, c, _ in points],
                [c for c, _ in fills],
                tokens=n,
                repeats=cfg.repeats,
                progress=progress,
            )
            for (b, c, held), t in zip(points, decode, strict=True):
                if t.seconds <= 0:
                    raise EndpointError(
                        f"{ep.url}: decode at batch {b}, context {c} measured no time per "
                        "step (the machine is too noisy for the window): raise --decode-tokens"
                    )
                s = StepSample(
                    phase="decode", endpoint=ep.url, tp=ep.tp, batch=b,
                    context=c + n / 2, seconds=t.seconds,
                )  # fmt: skip
                out.append(Measured(sample=s, timing=t, held_out=held))
                tag = " (held out)" if held else ""
                progress(f"  decode batch {b:>3} context {c:>6}: {t.seconds * 1e3:8.2f} ms{tag}")
            for (c, held), t in zip(fills, prefill, strict=True):
                s = StepSample(
                    phase="prefill", endpoint=ep.url, tp=ep.tp, batch=1, context=c,
                    seconds=t.seconds,
                )  # fmt: skip
                out.append(Measured(sample=s, timing=t, held_out=held))
                tag = " (held out)" if held else ""
                progress(f"  prefill {c:>6} tokens: {t.seconds * 1e3:8.2f} ms per request{tag}")
    return out


def train_folder(cfg: ProfileConfig, spec: str) -> tuple[str | None, str]:
    """The folder the micro-step loads, or None and why not."""
    if not cfg.train_step:
        return None, "skipped (--no-train-step)"
    if not trainstep.has_weights(spec):
        return None, f"skipped: {spec} is not a model folder with *.safetensors weights here"
    return spec, ""


def _train_step(
    cfg: ProfileConfig, result: ProfileResult, folder: str, progress: Callable[[str], None]
) -> float:
    """Time the micro-step and return train_mfu; a micro-step that fails (a model too
    large for this machine, say) is reported and train_mfu stays the base's: the
    endpoint measurements are not thrown away for it."""
    held = cfg.train_held_out
    lengths = [*cfg.train_lengths, *([held] if held else [])]
    progress(f"trainer micro-step (forward + backward) on {folder}: lengths {lengths}")
    try:
        timings, result.train_info = trainstep.measure(
            folder, [(cfg.train_sequences, n) for n in lengths], repeats=min(cfg.repeats, 5)
        )
    except ModelError as e:
        result.train_note = f"failed ({e}); train_mfu kept from the base"
        progress(f"  {result.train_note}")
        return result.base.eff.train_mfu
    result.train = [(t, t.length == held) for t in timings]
    fitted = [
        TrainSample(tokens=t.tokens, pairs=t.pairs, seconds=t.seconds)
        for t, held_out in result.train
        if not held_out
    ]
    info = result.train_info
    result.train_note = (
        f"measured: trainer micro-step on {socket.gethostname()} ({info.get('device')}, "
        f"{info.get('threads')} thread(s), {info.get('dtype')})"
    )
    return fit_train_mfu(result.model, result.base.flops, fitted)


def run_profile(
    cfg: ProfileConfig,
    *,
    progress: Callable[[str], None] = lambda _: None,
    clock: Callable[[], float] = time.perf_counter,
) -> ProfileResult:
    """Measure, fit, and build the profile (nothing is written here)."""
    from libra.profiling.report import profile_sources

    t0 = clock()
    endpoints = asyncio.run(describe_all(cfg))
    spec, model = resolve_model(cfg, endpoints)
    if cfg.base == "local":
        progress("calibrating this machine (the base profile: memory, peaks) ...")
    base = resolve_base(cfg, model)
    steps = asyncio.run(measure_endpoints(cfg, endpoints, model, progress, clock))
    try:
        fit = fit_hardware(model, base, [m.sample for m in steps if not m.held_out])
    except ValueError as e:
        raise ConfigError(f"cannot fit the measurements: {e}") from None
    result = ProfileResult(
        config=cfg, endpoints=endpoints, model_spec=spec, model=model, base=base,
        fit=fit, hardware=fit.hardware, steps=steps,
    )  # fmt: skip
    folder, result.train_note = train_folder(cfg, spec)
    mfu = base.eff.train_mfu
    if folder is not None:
        mfu = _train_step(cfg, result, folder, progress)
    result.created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    result.host = socket.gethostname()
    hw = fit.hardware
    result.hardware = replace(
        hw,
        id=cfg.id or f"{base.id}-profiled",
        name=f"{base.name}, profiled {result.created[:10]}",
        eff=replace(hw.eff, train_mfu=mfu),
    )
    result.hardware = replace(result.hardware, sources=profile_sources(result))
    result.wall_s = clock() - t0
    return result


__all__ = ["Measured", "ProfileResult", "resolve_model", "run_profile"]
