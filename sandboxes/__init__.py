"""Sandbox backends and image recipes, installed as `libra.sandboxes`.

    async with await open_backend("auto") as backend:      # docker | bwrap | auto
        async with await backend.create(SandboxSpec(image="busybox")) as sb:
            result = await sb.exec("echo hi", timeout=10)

See `docs/sandboxes.md` for the backends, their limits and what they protect against.
"""

from libra.sandboxes.auto import auto, open_backend
from libra.sandboxes.base import Backend, ExecResult, Sandbox, SandboxSpec

__all__ = ["Backend", "ExecResult", "Sandbox", "SandboxSpec", "auto", "open_backend"]
