"""Reading task and corpus files: small JSONL directly, bigger sets through `datasets`.

Each built-in env ships a small file; a user points it at a bigger local set
(`.jsonl` / `.json` / `.parquet` / `.csv`, a glob, or a folder of them). Sets above
`DIRECT_LIMIT` bytes or in columnar formats go through Hugging Face `datasets` (memory
mapped, cached), always offline: nothing is downloaded.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

import orjson

from libra.errors import ConfigError

DIRECT_LIMIT = 8 * 1024 * 1024
_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def _files(spec: str | Path) -> list[Path]:
    p = Path(spec)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix in _FORMATS)
    elif any(ch in str(spec) for ch in "*?["):
        files = sorted(Path(f) for f in glob.glob(str(spec)))
    else:
        files = [p] if p.is_file() else []
    if not files:
        raise ConfigError(
            f"no data files at {str(spec)!r} (give a .jsonl/.json/.parquet/.csv "
            "file, a glob or a folder of them)"
        )
    return files


def load_records(spec: str | Path) -> list[dict[str, Any]]:
    """All records of a local data file set, as dicts."""
    files = _files(spec)
    suffixes = {f.suffix for f in files}
    if suffixes <= {".jsonl"} and sum(f.stat().st_size for f in files) <= DIRECT_LIMIT:
        out = []
        for f in files:
            with open(f, "rb") as fh:
                for n, line in enumerate(fh, 1):
                    if line.strip():
                        try:
                            out.append(orjson.loads(line))
                        except orjson.JSONDecodeError as e:
                            raise ConfigError(f"{f}:{n}: not valid JSON ({e})") from None
        return out
    if len(suffixes) != 1 or next(iter(suffixes)) not in _FORMATS:
        raise ConfigError(f"mixed or unknown data formats in {spec!r}: {sorted(suffixes)}")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    ds = datasets.load_dataset(
        _FORMATS[next(iter(suffixes))], data_files=[str(f) for f in files], split="train"
    )
    return [dict(row) for row in ds]


__all__ = ["DIRECT_LIMIT", "load_records"]
