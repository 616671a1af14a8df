"""The sandbox contract: every backend (bubblewrap, Docker) passes this same suite."""

from __future__ import annotations

import asyncio
import secrets
import socket
from pathlib import Path

import pytest
from libra.sandboxes.base import Backend, SandboxSpec

from libra.errors import SandboxError
from tests.contracts.sandbox_fixtures import backend, host_processes_matching

__all__ = ["backend"]  # the fixture, imported for pytest

SMALL = SandboxSpec(image="busybox", memory_mb=128, pids=64)


async def test_exec_output_exit_code_and_argv(backend: Backend) -> None:
    async with await backend.create(SMALL) as sb:
        r = await sb.exec("echo out; echo err >&2; exit 3")
        assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n")
        assert not r.ok and not r.timed_out and not r.truncated
        r = await sb.exec(["printf", "%s|", "a b", "$HOME"])  # argv: no shell expansion
        assert r.ok and r.stdout == "a b|$HOME|"
        assert r.duration_s > 0


async def test_cwd_env_and_stdin(backend: Backend) -> None:
    spec = SandboxSpec(image="busybox", workdir="/work/proj", env={"A": "from-spec"})
    async with await backend.create(spec) as sb:
        assert (await sb.exec("pwd")).stdout == "/work/proj\n"
        await sb.exec("mkdir sub")
        assert (await sb.exec("pwd", cwd="sub")).stdout == "/work/proj/sub\n"
        r = await sb.exec('echo "$A $B"', env={"B": "from-exec"})
        assert r.stdout == "from-spec from-exec\n"
        r = await sb.exec("wc -c", stdin=b"x" * 300_000)  # more than a pipe buffer
        assert r.stdout.strip() == "300000"


async def test_output_is_capped_and_counted(backend: Backend) -> None:
    async with await backend.create(SMALL) as sb:
        r = await sb.exec("head -c 200000 /dev/zero | tr '\\0' a; echo tail >&2", max_output=1000)
        assert r.ok and r.truncated
        assert len(r.stdout) == 1000 and r.stdout_bytes == 200_000
        assert r.stderr == "tail\n" and r.stderr_bytes == 5


async def test_files_round_trip(backend: Backend, tmp_path: Path) -> None:
    async with await backend.create(SMALL) as sb:
        blob = bytes(range(256)) * 100
        await sb.write_file("deep/er/blob.bin", blob)
        assert await sb.read_file("/work/deep/er/blob.bin") == blob
        await sb.write_file("run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
        assert (await sb.exec("./run.sh")).stdout == "ran\n"
        with pytest.raises(FileNotFoundError):
            await sb.read_file("missing.txt")
        with pytest.raises(IsADirectoryError):
            await sb.read_file("deep")

        tree = tmp_path / "tree"
        (tree / "pkg").mkdir(parents=True)
        (tree / "pkg" / "mod.py").write_text("X = 1\n")
        (tree / "top.txt").write_text("top\n")
        await sb.copy_in(tree, "/work/copied")
        r = await sb.exec("cat copied/top.txt copied/pkg/mod.py")
        assert r.stdout == "top\nX = 1\n"
        await sb.exec("echo new > copied/pkg/new.txt")
        await sb.copy_out("/work/copied", tmp_path / "back")
        assert (tmp_path / "back" / "pkg" / "new.txt").read_text() == "new\n"
        assert (tmp_path / "back" / "top.txt").read_text() == "top\n"


async def test_file_ops_cannot_reach_the_host(backend: Backend, tmp_path: Path) -> None:
    secret = tmp_path / f"host-secret-{secrets.token_hex(4)}"
    secret.write_text("host only\n")
    async with await backend.create(SMALL) as sb:
        await sb.exec(f"ln -s {secret} link")
        with pytest.raises(FileNotFoundError):
            await sb.read_file("link")  # resolved inside the sandbox, where it dangles
        r = await sb.exec(f"cat {secret}")
        assert r.exit_code != 0 and "host only" not in r.stdout


async def test_timeout_kills_everything_and_sandbox_survives(backend: Backend) -> None:
    marker = str(700_000 + secrets.randbelow(99_999))
    async with await backend.create(SMALL) as sb:
        await sb.write_file("keep.txt", "kept\n")
        r = await sb.exec(f"sleep {marker} & sleep {marker} & sleep {marker}", timeout=1)
        assert r.timed_out and r.exit_code == 137 and not r.ok
        assert host_processes_matching(f"sleep {marker}") == []
        after = await sb.exec("cat keep.txt")
        assert after.ok and after.stdout == "kept\n"


async def test_sandboxes_are_isolated_from_each_other(backend: Backend) -> None:
    async with await backend.create(SMALL) as a, await backend.create(SMALL) as b:
        await a.write_file("/tmp/mine", "a\n")
        r = await b.exec("cat /tmp/mine")
        assert r.exit_code != 0
        results = await asyncio.gather(*(s.exec("echo $$; hostname") for s in (a, b, a, b)))
        assert all(r.ok for r in results)


async def test_network_is_off_by_default(backend: Backend) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        async with await backend.create(SMALL) as sb:
            r = await sb.exec("cat /proc/net/dev")
            interfaces = [line.split(":")[0].strip() for line in r.stdout.splitlines()[2:]]
            assert interfaces == ["lo"]
            r = await sb.exec(f"nc -w 2 127.0.0.1 {port} </dev/null && echo CONNECTED", timeout=10)
            assert "CONNECTED" not in r.stdout  # the host's loopback is not the sandbox's


async def test_memory_limit_oom_kills(backend: Backend) -> None:
    spec = SandboxSpec(image="busybox", memory_mb=64, pids=64)
    async with await backend.create(spec) as sb:
        r = await sb.exec("head -c 300000000 /dev/zero | tail -c 200000000 > /dev/null")
        assert r.exit_code == 137 and r.oom_killed
        ok = await sb.exec("echo alive")
        assert ok.ok and not ok.oom_killed


async def test_pids_limit_refuses_forks(backend: Backend) -> None:
    spec = SandboxSpec(image="busybox", memory_mb=128, pids=16)
    async with await backend.create(spec) as sb:
        r = await sb.exec("for i in $(seq 40); do sleep 3 & done; wait", timeout=20)
        assert "can't fork" in r.stderr or "Resource temporarily unavailable" in r.stderr


async def test_output_flood_is_killed(backend: Backend) -> None:
    async with await backend.create(SMALL) as sb:
        r = await sb.exec("cat /dev/zero", flood_limit=4 * 1024 * 1024, timeout=60)
        assert r.flooded and r.truncated and not r.timed_out and r.exit_code == 137
        assert 4 * 1024 * 1024 < r.stdout_bytes < 64 * 1024 * 1024
        assert (await sb.exec("echo alive")).stdout == "alive\n"


async def test_close_is_idempotent_and_final(backend: Backend) -> None:
    sb = await backend.create(SMALL)
    await sb.close()
    await sb.close()
    with pytest.raises(SandboxError):
        await sb.exec("true")


async def test_reaper_removes_expired_sandboxes(backend: Backend) -> None:
    sb = await backend.create(SandboxSpec(image="busybox", ttl_s=0.001))
    await asyncio.sleep(1.1)  # labels carry whole seconds
    reaped = await asyncio.to_thread(backend.reap)  # type: ignore[attr-defined]
    assert sb.id in reaped
    with pytest.raises(SandboxError):
        await sb.exec("true")


async def test_missing_image_is_a_clear_error(backend: Backend) -> None:
    with pytest.raises(SandboxError, match="never pulls|neither a recipe"):
        await backend.create(SandboxSpec(image="no-such-image-xyz"))


async def test_escaping_links_are_refused_with_a_sandbox_error(
    backend: Backend, tmp_path: Path
) -> None:
    """Links are copied as links (resolved inside the sandbox); a tree whose links point
    outside it does not come out to the host: one `SandboxError` naming the link."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "ok.txt").write_text("ok\n")
    (tree / "abs").symlink_to("/etc/passwd")
    async with await backend.create(SMALL) as sb:
        await sb.copy_in(tree, "/work/in")
        r = await sb.exec("readlink in/abs; cat in/ok.txt")
        assert r.stdout == "/etc/passwd\nok\n"
        await sb.exec("ln -s ../../etc out-up && mkdir t && ln -s /etc/hostname t/h")
        for src, name in (("out-up", "out-up"), ("t", "t/h"), ("in", "in/abs")):
            with pytest.raises(SandboxError, match=f"copy_out /work/{src}: refused .*{name}"):
                await sb.copy_out(src, tmp_path / "back" / src)
        assert not (tmp_path / "back" / "t").exists()
