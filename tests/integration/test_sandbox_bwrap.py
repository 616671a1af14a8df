"""bubblewrap: the rlimit fallback without cgroups (what a non-root user gets), the sized
writable layer as root, and what the sandbox can read of the host."""

from __future__ import annotations

from pathlib import Path

import pytest
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


async def test_no_host_path_is_readable_inside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The overlay's options (/proc/self/mountinfo) and bwrap's command line (PID 1's
    /proc/1/cmdline) named the sandbox's folder and the image's rootfs on the host, and
    bwrap's environment (/proc/1/environ) was the host process's, secrets included."""
    monkeypatch.setenv("LIBRA_TEST_HOST_SECRET", "sk-do-not-leak")
    need(BwrapBackend.available() is None, "bubblewrap unavailable")
    async with BwrapBackend(state_dir=tmp_path / "state") as backend:
        sb = await backend.create(SandboxSpec(image="busybox", memory_mb=64))
        seen = await sb.exec(
            "cat /proc/self/mountinfo /proc/1/cmdline /proc/*/cmdline /proc/*/environ "
            "/proc/mounts; ls -l /proc/1/fd /proc/self/fd",
            env={"SECRETISH": "x" * 100_000},  # options past a pipe's 64 KiB
        )
        assert seen.exit_code == 0 and "lowerdir=lower" in seen.stdout
        for host in (str(tmp_path), str(sb.rootfs), "libra", "sk-do-not-leak"):  # type: ignore[attr-defined]
            assert host not in seen.stdout
        assert (await sb.exec("echo $SECRETISH | wc -c", env={"SECRETISH": "y"})).stdout == "2\n"
