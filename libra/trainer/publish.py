"""Weight publishing: a versioned HF folder per step, then each endpoint's load call.

CPU path (this module): the trainer writes `{dir}/v{version}` atomically (safetensors +
config + tokenizer files) and tells every endpoint to load it through
`libra.engine.weights.load_weights` (embedded engine: `POST /v1/load_weights`; vLLM:
pause, `collective_rpc reload_weights`, reset prefix cache, resume). Old versions
beyond `keep` are deleted.

GPU path (documented in docs/elastic.md, not implemented here): broadcast the
parameters over NCCL from trainer rank 0 into the inference workers' weight-update
group (vLLM's weight-transfer engine), no disk round trip.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

from libra.trainer.config import PublishConfig


def version_dir(cfg: PublishConfig, version: int) -> Path:
    assert cfg.dir is not None
    return Path(cfg.dir) / f"v{version}"


def prune(cfg: PublishConfig) -> None:
    """Delete all but the newest `keep` version folders."""
    assert cfg.dir is not None
    folders = sorted(
        (p for p in Path(cfg.dir).glob("v*") if p.is_dir() and p.name[1:].isdigit()),
        key=lambda p: int(p.name[1:]),
    )
    for p in folders[: -cfg.keep]:
        shutil.rmtree(p, ignore_errors=True)


async def _notify(cfg: PublishConfig, path: str) -> list[dict[str, Any]]:
    import aiohttp

    from libra.engine.weights import load_weights

    async with aiohttp.ClientSession() as session:
        return list(
            await asyncio.gather(
                *(load_weights(session, e.url, e.kind, path) for e in cfg.endpoints)
            )
        )


def notify(cfg: PublishConfig, path: str | Path) -> list[dict[str, Any]]:
    """Tell every configured endpoint to load the folder (blocking; runs its own loop)."""
    if not cfg.endpoints:
        return []
    return asyncio.run(_notify(cfg, str(Path(path).resolve())))


__all__ = ["notify", "prune", "version_dir"]
