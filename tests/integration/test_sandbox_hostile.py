"""Hostile code through the `bash` tool, on every backend: each limit is seen acting,
the episode gets a tool return saying so, and nothing is left behind afterwards."""

from __future__ import annotations

import asyncio
import secrets
import socket

import pytest
from libra.sandboxes.base import Backend, Sandbox, SandboxSpec
from libra.tools.shell import SHOWN_BYTES, bash

import libra
from tests.contracts.sandbox_fixtures import backend, host_processes_matching

__all__ = ["backend"]

SPEC = SandboxSpec(image="busybox", memory_mb=64, pids=64)


async def run_script(sb: Sandbox, body: str, timeout: int = 10) -> tuple[libra.ToolResult, str]:
    """Run `body` as a uniquely named script so that its processes can be found later."""
    marker = f"hostile-{secrets.token_hex(4)}"
    await sb.write_file(f"/work/{marker}.sh", body, mode=0o755)
    ctx = libra.Context(episode_id=marker, task={}, sandbox=sb)
    result = await bash.invoke({"command": f"sh /work/{marker}.sh", "timeout": timeout}, ctx)
    return result, marker


async def assert_gone(backend: Backend, sb: Sandbox, marker: str) -> None:
    await sb.close()
    assert host_processes_matching(marker) == []
    if backend.name == "docker":
        ids = [
            c["Id"]
            for c in await asyncio.to_thread(
                backend.api.containers, all=True, filters={"label": "libra.sandbox"}
            )
        ]  # type: ignore[attr-defined]
        assert sb.id not in ids
    else:
        assert not sb.state.exists()  # type: ignore[attr-defined]
        if sb.cgroup is not None:  # type: ignore[attr-defined]
            assert not any(d.exists() for d in sb.cgroup.dirs)  # type: ignore[attr-defined]


async def test_fork_bomb_hits_the_pids_limit(backend: Backend) -> None:
    sb = await backend.create(SPEC)
    result, marker = await run_script(sb, "bomb() { bomb | bomb & }; bomb; sleep 30\n", timeout=10)
    assert result.status in ("timeout", "error")
    assert result.info and result.info["timed_out"] in (True, False)
    assert "can't fork" in result.content or "Resource temporarily unavailable" in result.content
    probe = await sb.exec("echo still-usable", timeout=30)
    assert probe.stdout == "still-usable\n"
    await assert_gone(backend, sb, marker)


async def test_memory_hog_is_oom_killed(backend: Backend) -> None:
    sb = await backend.create(SPEC)
    result, marker = await run_script(
        sb, "head -c 400000000 /dev/zero | tail -c 300000000 > /dev/null\necho exit=$?\n", 120
    )
    assert result.info is not None and result.info["oom_killed"]
    # The kernel picks the victim: usually the hog (`tail`; the script goes on and echoes
    # exit=137); on a busy machine CI has also seen the shell itself killed (the command
    # then ends with 137). Either way the model is told, and the sandbox stays usable.
    if "exit=137" not in result.content:
        assert result.info["exit_code"] == 137
        assert "killed by the OOM killer" in result.content
    probe = await sb.exec("echo still-usable", timeout=30)
    assert probe.stdout == "still-usable\n"
    await assert_gone(backend, sb, marker)


async def test_network_attempt_reaches_nothing(backend: Backend) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        sb = await backend.create(SPEC)
        result, marker = await run_script(
            sb,
            f"cat /proc/net/dev\necho routes=$(tail -n +2 /proc/net/route | wc -l)\n"
            f"nc -w 3 127.0.0.1 {port} </dev/null && echo CONNECTED\n",
        )
        assert "CONNECTED" not in result.content
        assert "eth0" not in result.content and "lo:" in result.content
        assert "routes=0" in result.content  # no route anywhere: every address unreachable
        with pytest.raises(TimeoutError):  # nothing ever knocked on the host's port
            server.accept()
    await assert_gone(backend, sb, marker)


async def test_infinite_loop_is_killed_at_its_timeout(backend: Backend) -> None:
    sb = await backend.create(SPEC)
    result, marker = await run_script(sb, "while :; do :; done\n", timeout=2)
    assert result.status == "timeout"
    assert result.info and result.info["timed_out"] and result.info["exit_code"] == 137
    assert host_processes_matching(marker) == []  # killed, not merely abandoned
    await assert_gone(backend, sb, marker)


async def test_a_gigabyte_of_output_is_cut_off(backend: Backend) -> None:
    sb = await backend.create(SPEC)
    result, marker = await run_script(sb, "head -c 1000000000 /dev/zero | tr '\\0' x\n", 60)
    assert result.status == "error" and result.info is not None
    assert result.info["flooded"] and result.info["truncated"]
    assert result.info["stdout_bytes"] < 100_000_000  # stopped long before 1 GB
    assert len(result.content) < 2 * SHOWN_BYTES + 500  # what the model sees stays small
    await assert_gone(backend, sb, marker)


async def test_nothing_outlives_the_backend(backend: Backend) -> None:
    marker = f"sleep {600_000 + secrets.randbelow(99_999)}"
    sbs = [await backend.create(SPEC) for _ in range(3)]
    for sb in sbs:
        await sb.exec(f"{marker} > /dev/null 2>&1 &", timeout=10)
    await backend.aclose()
    assert all(sb.closed for sb in sbs)
    assert host_processes_matching(marker) == []
