"""File operations for sandboxes, done from inside with `cat` and `tar`.

Going through the sandbox (rather than touching its files from the host) means a
symlink the sandboxed code planted (`/work/x -> /etc/shadow`) resolves inside the
sandbox, never on the host. The image needs `sh`, `cat`, `mkdir`, `chmod` and `tar`
(busybox and Debian have them). Trees come back out through Python's `tarfile` with
the `data` filter: no absolute paths, no links leaving the destination, no devices; a
tree the filter refuses (a symlink the sandboxed code pointed outside it) is a
`SandboxError` naming the entry. Packing and unpacking trees is proportional to their
size, so it runs in a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import io
import shlex
import shutil
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

from libra.sandboxes.base import RawExec, Sandbox

from libra.errors import SandboxError

FILE_LIMIT = 256 * 1024 * 1024
"""Largest file or archive moved in one operation."""
FILE_TIMEOUT_S = 120.0


def tar_bytes(src: Path, arcname: str) -> bytes:
    """An uncompressed tar of a host file or tree, its top entry named `arcname`."""
    if not src.exists():
        raise FileNotFoundError(f"copy_in: {src} does not exist")

    def as_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
        # Host uids mean nothing inside (and are unmapped in a user namespace).
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(src, arcname=arcname, filter=as_root)
    return buf.getvalue()


def untar_to(data: bytes, name: str, dest: Path) -> None:
    """Extract entry `name` (file or tree) of a tar to host path `dest`, safely."""
    dest = Path(dest)
    with tempfile.TemporaryDirectory(dir=dest.parent if dest.parent.exists() else None) as tmp:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(tmp, filter="data")
        got = Path(tmp) / name
        if not got.exists() and not got.is_symlink():
            raise FileNotFoundError(f"copy_out: {name} not found in the archive")
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        elif dest.exists() or dest.is_symlink():
            dest.unlink()
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(got), dest)


def _failed(what: str, path: str, raw: RawExec) -> Exception:
    err = raw.err.text().strip()
    if raw.timed_out:
        return SandboxError(f"{what} {path}: timed out")
    if "No such file" in err or "can't open" in err or "not found" in err:
        return FileNotFoundError(f"{what}: {path} does not exist in the sandbox")
    return SandboxError(f"{what} {path} failed: {err or f'exit code {raw.exit_code}'}")


class ExecFileOps(Sandbox):
    """`read_file` / `write_file` / `copy_in` / `copy_out` on top of `exec_raw`."""

    async def _run(self, script: str, stdin: bytes | None = None) -> RawExec:
        return await self.exec_raw(
            ["/bin/sh", "-c", script],
            stdin=stdin,
            timeout=FILE_TIMEOUT_S,
            max_output=FILE_LIMIT,
            flood_limit=FILE_LIMIT,
            cwd="/",
        )

    async def read_file(self, path: str) -> bytes:
        target = self.resolve(path)
        q = shlex.quote(target)
        raw = await self._run(f"[ -d {q} ] && exit 21; cat -- {q}")
        if raw.exit_code == 21:
            raise IsADirectoryError(f"read_file: {target} is a directory")
        if raw.exit_code != 0 or raw.out.truncated:
            raise _failed("read_file", target, raw)
        return raw.out.bytes()

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        target = PurePosixPath(self.resolve(path))
        payload = data.encode() if isinstance(data, str) else data
        q, parent = shlex.quote(str(target)), shlex.quote(str(target.parent))
        raw = await self._run(
            f"mkdir -p -- {parent} && cat > {q} && chmod {mode:o} -- {q}", stdin=payload
        )
        if raw.exit_code != 0:
            raise _failed("write_file", str(target), raw)

    async def copy_in(self, src: str | Path, dest: str) -> None:
        target = PurePosixPath(self.resolve(dest))
        try:
            data = await asyncio.to_thread(tar_bytes, Path(src), target.name)
        except FileNotFoundError:
            raise
        except (tarfile.TarError, OSError) as e:
            raise SandboxError(f"copy_in {src}: cannot pack it: {e}") from None
        parent = shlex.quote(str(target.parent))
        raw = await self._run(
            f"mkdir -p -- {parent} && rm -rf -- {shlex.quote(str(target))} && "
            f"tar -x -f - -C {parent}",
            stdin=data,
        )
        if raw.exit_code != 0:
            raise _failed("copy_in", str(target), raw)

    async def copy_out(self, src: str, dest: str | Path) -> None:
        source = PurePosixPath(self.resolve(src))
        raw = await self._run(
            f"tar -c -f - -C {shlex.quote(str(source.parent))} -- {shlex.quote(source.name)}"
        )
        if raw.exit_code != 0 or raw.out.truncated:
            raise _failed("copy_out", str(source), raw)
        try:
            await asyncio.to_thread(untar_to, raw.out.bytes(), source.name, Path(dest))
        except FileNotFoundError:
            raise
        except tarfile.FilterError as e:
            raise SandboxError(
                f"copy_out {source}: refused {e} (only links that stay inside the copied "
                "tree come out; remove or replace that link in the sandbox first)"
            ) from None
        except (tarfile.TarError, OSError) as e:
            raise SandboxError(f"copy_out {source} to {dest}: {e}") from None


__all__ = ["FILE_LIMIT", "ExecFileOps", "tar_bytes", "untar_to"]
