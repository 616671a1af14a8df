"""Where Libra keeps its own files, and which folders it never replaces.

Files Libra makes for itself and keeps between runs (the default model, a taskset's task
list) go to the user's cache folder (`user_cache`), not to the shared temp folder, where
another user of the machine could make the file or its folder first (a folder of theirs
holding the file Libra reads, or a link where Libra writes)."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache(*parts: str) -> Path:
    """`parts` under the user's cache folder for Libra, `$XDG_CACHE_HOME/libra`, else
    `~/.cache/libra` (not created)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base, "libra", *parts)


def holds_working_folder(path: Path) -> bool:
    """Whether `path` is the working folder or one above it (a home, `/`), which a
    command that replaces a folder must refuse whatever it holds."""
    here, target = Path.cwd().resolve(), path.resolve()
    return target == here or target in here.parents


__all__ = ["holds_working_folder", "user_cache"]
