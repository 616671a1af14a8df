"""bubblewrap without cgroups: the rlimit fallback (what a non-root user gets)."""

from __future__ import annotations

from pathlib import Path

from libra.sandboxes.base import SandboxSpec
from libra.sandboxes.bwrap import BwrapBackend

from tests.conftest import need


async def test_without_cgroups_the_address_space_rlimit_holds(tmp_path: Path) -> None:
    need(BwrapBackend.available() is None, "bubblewrap unavailable")
    async with BwrapBackend(use_cgroups=False, state_dir=tmp_path / "state") as backend:
        assert backend.info()["cgroups"] is None
        sb = await backend.create(SandboxSpec(image="busybox", memory_mb=64))
        r = await sb.exec("head -c 300000000 /dev/zero | tail -c 200000000 >/dev/null; echo rc=$?")
        # per-process address-space limit: the allocation fails instead of an OOM kill
        assert "out of memory" in r.stderr and r.stdout == "rc=1\n" and not r.oom_killed
        assert (await sb.exec("echo fine")).stdout == "fine\n"
