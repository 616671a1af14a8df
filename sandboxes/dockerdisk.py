"""What a Docker sandbox may write, and how much (`SandboxSpec.disk_mb`).

Left alone, a container writes into its own layer on the host's disk without a limit
(10 GiB in 6 s in a probe). `DockerBackend(disk=...)` picks one of:

- `quota`: the engine caps the container's layer (`storage_opt size`). Only overlay2 on
  xfs mounted with project quotas supports it; `auto` uses it there.
- `tmpfs`: the root filesystem is read-only; the workdir, /tmp, /var/tmp and /root are
  folders of one tmpfs of `disk_mb` that the backend mounts on the host for the sandbox
  and binds in. The four share the cap (a write past it fails with ENOSPC); the pages
  are memory, charged to the sandbox's memory cgroup, so what it keeps written also
  counts against `memory_mb`; the files survive the restart after a timeout (the mount
  is the host's) and go with the sandbox. An image's own files in those folders are
  hidden. Needs root and the engine on this host; `auto` uses it when quota is not
  available.
- `none`: no limit (a remote engine, or not root); the backend warns.

Host state: `$LIBRA_DOCKER_STATE` (default /dev/shm/libra-docker-UID)/BACKEND/SANDBOX,
with `owner.json` per backend for reaping what a dead owner left (`reap_stale`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from libra.sandboxes import owner
from libra.sandboxes.base import SandboxSpec

log = logging.getLogger("libra.sandboxes")
MODES = ("auto", "quota", "tmpfs", "none")
STATE_LABEL = "libra.state"
"""Container label: the host folder holding the sandbox's writable tmpfs."""
WRITABLE = ("/tmp", "/var/tmp", "/root")
"""Writable beside the workdir under `tmpfs` (HOME is /root)."""


def state_root() -> Path:
    if env := os.environ.get("LIBRA_DOCKER_STATE"):
        return Path(env)
    return Path("/dev/shm") / f"libra-docker-{os.geteuid()}"


def choose(mode: str, info: dict[str, Any], engine: str | None) -> str:
    """The disk mode for `mode` (one of MODES) on an engine whose `docker info` is
    `info`; `tmpfs` and `quota` are refused where they cannot work."""
    if mode not in MODES:
        raise ValueError(f"disk={mode!r}: expected one of {', '.join(MODES)}")
    status = dict(info.get("DriverStatus") or [])
    quota_fs = info.get("Driver") == "overlay2" and status.get("Backing Filesystem") == "xfs"
    local = bool(engine) and str(engine).startswith("unix://")
    can_tmpfs = local and os.geteuid() == 0
    if mode == "auto":
        mode = "quota" if quota_fs else ("tmpfs" if can_tmpfs else "none")
        if mode == "none":
            log.warning(
                "docker backend: sandboxes have no disk limit (the engine's storage has no "
                "quota and %s); see docs/sandboxes.md",
                "this process is not root" if local else "the engine is not on this host",
            )
    elif mode == "tmpfs" and not can_tmpfs:
        raise ValueError("disk='tmpfs' needs root and the engine on this host (unix socket)")
    return mode


def host_config(mode: str, spec: SandboxSpec, folder: Path | None) -> dict[str, Any]:
    """Keyword arguments for `create_host_config` that apply the limit."""
    if mode == "quota":
        return {"storage_opt": {"size": f"{spec.disk_mb}M"}}
    if mode == "tmpfs":
        assert folder is not None
        return {"read_only": True, "binds": {
            str(folder / "rw" / _name(target)): {"bind": target, "mode": "rw"}
            for target in _targets(spec)
        }}  # fmt: skip
    return {}


def prepare(folder: Path, spec: SandboxSpec) -> None:
    """Mount the sandbox's tmpfs of `disk_mb` at folder/rw with one folder per writable
    path (blocking)."""
    rw = folder / "rw"
    rw.mkdir(parents=True)
    opts = f"size={spec.disk_mb}m,mode=0755,nosuid,nodev"
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(rw)],
                   check=True, capture_output=True)  # fmt: skip
    for target in _targets(spec):
        sub = rw / _name(target)
        sub.mkdir()
        sub.chmod(0o1777 if target in ("/tmp", "/var/tmp") else 0o755)


def release(folder: Path) -> None:
    """Unmount and remove a sandbox's folder (blocking; nothing there is fine)."""
    rw = folder / "rw"
    if os.path.ismount(rw):
        subprocess.run(["umount", "-l", str(rw)], check=False, capture_output=True)
    shutil.rmtree(folder, ignore_errors=True)


def claim(backend_dir: Path) -> None:
    """A backend's own folder, with its owner for `reap_stale`, in the private state
    root (`owner.private_folder`)."""
    owner.private_folder(backend_dir.parent)
    backend_dir.mkdir(mode=0o700, exist_ok=True)
    (backend_dir / "owner.json").write_text(json.dumps(owner.current().labels()))


def release_all(backend_dir: Path) -> None:
    """Release every sandbox folder of a backend, then its own (blocking); a link or an
    entry of another user is left alone (never followed out of the state root)."""
    if not owner.own_entry(backend_dir):
        return
    for folder in backend_dir.iterdir():
        if owner.own_entry(folder):
            release(folder)
    shutil.rmtree(backend_dir, ignore_errors=True)


def reap_stale(root: Path) -> None:
    """Release the folders of backends whose owner died (blocking)."""
    if not root.is_dir():
        return
    owner.private_folder(root)
    for backend_dir in root.iterdir():
        if not owner.own_entry(backend_dir):
            continue
        try:
            labels = json.loads((backend_dir / "owner.json").read_text())
        except (OSError, ValueError):
            if time.time() - backend_dir.stat().st_mtime > 60:  # not one being made now
                release_all(backend_dir)
            continue
        if owner.should_reap({**labels, "libra.expires": "inf"}):
            release_all(backend_dir)


def _targets(spec: SandboxSpec) -> list[str]:
    out = [spec.workdir.rstrip("/") or "/"]
    out += [t for t in WRITABLE if t not in out]
    return [t for t in out if t != "/"]


def _name(target: str) -> str:
    return target.strip("/").replace("/", "_") or "root"


__all__ = [
    "MODES",
    "STATE_LABEL",
    "choose",
    "claim",
    "host_config",
    "prepare",
    "reap_stale",
    "release",
    "release_all",
    "state_root",
]
