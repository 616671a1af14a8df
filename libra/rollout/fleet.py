"""Buckets from config and flags: names, TP sizes, bounds, endpoint URLs.

Flags (DESIGN.md): `--endpoint BUCKET=URL` (repeatable) adds an endpoint to a bucket;
`--bucket NAME=TP:BOUND` (repeatable) declares a bucket's TP size and bound. Buckets
named `tpN` default to TP N; bounds default to the model's context split evenly in log
space (`libra.routing.default_bounds`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from libra.endpoints.config import BucketConfig
from libra.errors import ConfigError
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
        except Exception as e:
            raise ConfigError(f"bucket {name!r}: {e}") from None
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


__all__ = ["merge_bucket_flags", "resolve_buckets"]
