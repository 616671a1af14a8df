"""The user's cache folder for Libra: `$XDG_CACHE_HOME/libra`, else `~/.cache/libra`.

Files Libra makes for itself and keeps between runs (the default model, a taskset's task
list) go here, not to the shared temp folder, where another user of the machine could
make the file or its folder first (a folder of theirs holding the file Libra reads, or a
link where Libra writes)."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache(*parts: str) -> Path:
    """`parts` under the user's cache folder for Libra (not created)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base, "libra", *parts)


__all__ = ["user_cache"]
