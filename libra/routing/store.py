"""Reading and writing routing state files (the only I/O of `libra.routing`).

Call these off the event loop (`asyncio.to_thread`): a tree of 100k nodes takes tens of
milliseconds to write.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from libra.errors import ConfigError


def write_atomic(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` so that a reader sees the old file or the new one, never
    half of one (temp file in the same folder, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read(path: str | Path) -> bytes | None:
    """The file's bytes, or None when it does not exist yet."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:  # a folder, a file this user cannot read: was a traceback
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e}); it names the file "
                          "the routing state is kept in") from None  # fmt: skip


__all__ = ["read", "write_atomic"]
