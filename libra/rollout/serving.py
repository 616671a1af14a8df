"""What a job serves: the model folder, its tokenizer, the context limit and the buckets
(names, TP sizes, bounds, endpoint URLs) from config and flags.

Flags (DESIGN.md): `--endpoint BUCKET=URL` (repeatable) adds an endpoint to a bucket;
`--bucket NAME=TP:BOUND` (repeatable) declares a bucket's TP size and bound. Buckets
named `tpN` default to TP N; bounds default to the model's context split evenly in log
space (`libra.routing.default_bounds`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from libra.chat import ChatTokenizer
from libra.cluster import backend
from libra.cluster.config import ClusterSection, LaunchSection
from libra.cluster.engines import Launched
from libra.config import format_validation_error
from libra.endpoints.config import BucketConfig, EndpointConfig
from libra.endpoints.pool import EndpointPool
from libra.errors import ConfigError, ModelError
from libra.rollout.supervise import EngineWatch
from libra.routing.base import Bucket, default_bounds

_TP_NAME = re.compile(r"^tp(\d+)$")


def merge_bucket_flags(
    buckets: Sequence[BucketConfig],
    endpoint_flags: Sequence[tuple[str, str]],
    bucket_flags: Sequence[tuple[str, str]],
) -> list[BucketConfig]:
    """Config buckets + `--bucket NAME=TP:BOUND` + `--endpoint NAME=URL`."""
    by_name: dict[str, dict[str, object]] = {b.name: b.model_dump() for b in buckets}
    for name, spec in bucket_flags:
        tp_s, sep, bound_s = spec.partition(":")
        try:
            tp = int(tp_s)
            bound = int(bound_s) if sep and bound_s else None
        except ValueError:
            raise ConfigError(
                f"--bucket {name}={spec}: expected NAME=TP:BOUND, e.g. tp2=2:16384"
            ) from None
        entry = by_name.setdefault(name, {"name": name})
        entry["tp"] = tp
        if bound is not None:
            entry["bound"] = bound
    for name, url in endpoint_flags:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(
                f"--endpoint {name}={url}: the URL must start with http:// or https://"
            )
        entry = by_name.setdefault(name, {"name": name})
        urls: list[str] = list(entry.get("endpoints") or [])  # type: ignore[call-overload]
        entry["endpoints"] = [*urls, url.rstrip("/")]
    out = []
    for name, entry in by_name.items():
        m = _TP_NAME.match(name)
        if m and "tp" not in entry:
            entry["tp"] = int(m.group(1))
        try:
            out.append(BucketConfig.model_validate(entry))
        except ValidationError as e:
            raise ConfigError(format_validation_error(e, f"bucket {name!r}")) from None
    return out


def resolve_buckets(buckets: Sequence[BucketConfig], max_context: int) -> list[Bucket]:
    """Fill default bounds; buckets come back sorted by bound."""
    if not buckets:
        raise ConfigError("no buckets: give --endpoint BUCKET=URL or [[buckets]] in the config")
    missing = [b for b in buckets if b.bound is None]
    defaults = iter(default_bounds([b.name for b in missing], max_context)) if missing else None
    # Buckets without a bound take the default bounds in order of TP size.
    order = sorted(missing, key=lambda b: b.tp)
    filled = {b.name: next(defaults) for b in order} if defaults is not None else {}
    out = [Bucket(b.name, b.tp, b.bound or filled[b.name]) for b in buckets]
    out.sort(key=lambda b: b.bound)
    bounds = [b.bound for b in out]
    if len(set(bounds)) != len(bounds):
        raise ConfigError(f"bucket bounds must differ; got {bounds}")
    if out[-1].bound > max_context:
        raise ConfigError(
            f"bucket {out[-1].name!r} bound {out[-1].bound} exceeds the model context {max_context}"
        )
    return out


@dataclass(slots=True)
class Serving:
    """What a job serves: the model folder, its tokenizer, the context limit and the
    buckets (with the endpoints and embedded engines each one asks for)."""

    model_dir: Path
    tokenizer: ChatTokenizer
    max_context: int
    configs: list[BucketConfig]
    buckets: list[Bucket]

    @property
    def configured_urls(self) -> list[str]:
        return [u for b in self.configs for u in b.endpoints]


def resolve_model(model: str | None) -> Path:
    """The model folder: the given path, or the default tiny model (made on first use)."""
    if model is not None:
        path = Path(model)
        if not path.is_dir():
            raise ModelError(f"model folder {model!r} does not exist")
        return path
    from libra.engine.model_maker import ensure_default_model

    return ensure_default_model()


def model_context(model_dir: Path) -> int | None:
    cfg = model_dir / "config.json"
    if not cfg.is_file():
        return None
    value = json.loads(cfg.read_text()).get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


def resolve_serving(
    model: str | None, max_context: int | None, buckets: Sequence[BucketConfig]
) -> Serving:
    """Model folder, tokenizer, context limit and buckets; without buckets, one bucket
    `tp1` served by one embedded engine started for the job."""
    model_dir = resolve_model(model)
    tokenizer = ChatTokenizer(model_dir)
    context = max_context or model_context(model_dir)
    if context is None:
        raise ConfigError(
            f"{model_dir}/config.json has no max_position_embeddings; set limits.max_context"
        )
    configs = list(buckets) or [BucketConfig(name="tp1", tp=1, launch=1)]
    return Serving(model_dir, tokenizer, context, configs, resolve_buckets(configs, context))


@contextlib.asynccontextmanager
async def open_pool(
    serving: Serving,
    config: EndpointConfig,
    *,
    cluster: ClusterSection | None = None,
    launch: LaunchSection | None = None,
    joined_later: bool = False,
    watch: EngineWatch | None = None,
) -> AsyncIterator[EndpointPool]:
    """Start the engines the buckets ask for (`launch = N`: embedded engines, or vLLM
    servers at the bucket's TP size with `launch.kind = "vllm"`; local processes, or
    Ray actors with `cluster.backend = "ray"`, each engine's node named on stderr), then
    the endpoint pool over them and the configured URLs; both stop when the block ends.
    Launched engines that exit or are lost with their node are replaced meanwhile
    (`watch`, default `EngineWatch()`; `libra.rollout.supervise`).
    (`joined_later`: as `EndpointPool` takes it.)"""
    urls = {b.name: list(b.endpoints) for b in serving.configs}
    counts = {b.name: b.launch for b in serving.configs}
    launched = None
    async with contextlib.AsyncExitStack() as stack:
        if any(counts.values()):
            section, how = cluster or ClusterSection(), launch or LaunchSection()
            vllm = how.kind == "vllm"
            tps = {b.name: b.tp if vllm else 1 for b in serving.configs}
            placement = backend.launch_placement(
                how, section, sum(n * tps[b] for b, n in counts.items())
            )
            local = await asyncio.to_thread(backend.launch_launcher, how)  # runs vllm
            launcher = backend.place(section, local)
            launched = Launched(serving.model_dir, counts, tps=tps, placement=placement,
                                launcher=launcher)  # fmt: skip
            started = await stack.enter_async_context(launched)
            for name, extra in started.items():
                urls[name] += extra
            if section.backend == "ray" or vllm:  # where each one runs
                for bucket, es in launched.engines.items():
                    for e in es:
                        where = f"Ray node {e.slot.node}" if section.backend == "ray" else (
                            e.slot.describe())  # fmt: skip
                        print(f"libra: engine {e.worker} on {where} at {e.url} ({e.kind}, "
                              f"tp={tps[bucket]})", file=sys.stderr, flush=True)  # fmt: skip
        pool = EndpointPool(
            [(b, urls[b.name]) for b in serving.buckets], config, joined_later=joined_later
        )
        await stack.enter_async_context(pool)
        if launched is not None:
            await stack.enter_async_context((watch or EngineWatch()).running(launched, pool))
        yield pool


__all__ = [
    "Serving",
    "merge_bucket_flags",
    "model_context",
    "open_pool",
    "resolve_buckets",
    "resolve_model",
    "resolve_serving",
]
