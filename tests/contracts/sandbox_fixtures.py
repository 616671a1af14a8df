"""Backends under test: every sandbox backend passes the same suite.

bubblewrap needs `bwrap` (apt-get install bubblewrap); Docker needs an engine that
answers (`.ci/stage-docker.sh` starts one in CI). Locally a missing one skips; under
CI=true it fails (tests.conftest.need)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from libra.sandboxes.base import Backend

from tests.conftest import need

BACKENDS = ["bwrap", pytest.param("docker", marks=pytest.mark.docker)]


def host_processes_matching(marker: str) -> list[str]:
    """Command lines of host processes containing `marker` (sandboxes share the kernel,
    so whatever still runs inside one shows up here)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and "pytest" not in cmdline:
            found.append(f"{proc.name}: {cmdline}")
    return found


async def start_backend(name: str, tmp_path: Path, **options: object) -> Backend:
    if name == "docker":
        from libra.sandboxes.docker import DockerBackend, engine_answers

        why = engine_answers()
        need(why is None, f"no Docker engine: {why}")
        backend: Backend = DockerBackend(**options)  # type: ignore[arg-type]
    else:
        from libra.sandboxes.bwrap import BwrapBackend

        why = BwrapBackend.available()
        need(why is None, f"bubblewrap unavailable: {why}")
        backend = BwrapBackend(state_dir=tmp_path / "bwrap-state", **options)  # type: ignore[arg-type]
    await backend.start()
    return backend


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    b = await start_backend(request.param, tmp_path)
    try:
        yield b
    finally:
        await b.aclose()
