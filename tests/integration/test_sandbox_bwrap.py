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


async def test_as_root_the_writable_layer_is_a_sized_tmpfs(tmp_path: Path) -> None:
    need(BwrapBackend.available() is None, "bubblewrap unavailable")
    backend = BwrapBackend(state_dir=tmp_path / "state")
    need(backend.use_cgroups, "needs root (the tmpfs mount and cgroups)")
    async with backend:
        sb = await backend.create(SandboxSpec(image="busybox", disk_mb=8, memory_mb=256))
        r = await sb.exec("head -c 20000000 /dev/zero > /work/big; echo rc=$?; wc -c < /work/big")
        rc, size = r.stdout.split()
        assert rc == "rc=1" and int(size) <= 8 * 1024 * 1024  # the write failed at 8 MiB
        await sb.exec("rm /work/big")
        assert (await sb.exec("echo fits > /tmp/small && cat /tmp/small")).stdout == "fits\n"
