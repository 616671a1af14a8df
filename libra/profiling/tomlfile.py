"""Writing a profile as TOML (the standard library reads TOML but does not write it).

Enough of TOML for a hardware profile: strings, numbers, booleans, lists of those,
tables, and arrays of tables. Plain values come before sub-tables at every level, as
TOML requires.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(k: str) -> str:
    return k if _BARE.match(k) else json.dumps(k)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # JSON's escapes are valid in a TOML basic string
    if isinstance(v, Sequence):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def _is_table_array(v: Any) -> bool:
    return (
        isinstance(v, Sequence)
        and not isinstance(v, str)
        and bool(v)
        and all(isinstance(x, Mapping) for x in v)
    )


def _table(doc: Mapping[str, Any], path: list[str], out: list[str]) -> None:
    plain = {k: v for k, v in doc.items() if not isinstance(v, Mapping) and not _is_table_array(v)}
    for k, v in plain.items():
        if v is not None:
            out.append(f"{_key(k)} = {_value(v)}")
    for k, v in doc.items():
        if isinstance(v, Mapping):
            sub = [*path, _key(k)]
            out += ["", f"[{'.'.join(sub)}]"]
            _table(v, sub, out)
        elif _is_table_array(v):
            sub = [*path, _key(k)]
            for item in v:
                out += ["", f"[[{'.'.join(sub)}]]"]
                _table(item, sub, out)


def dumps(doc: Mapping[str, Any], header: str = "") -> str:
    """`doc` as TOML text; `header` lines become comments at the top. None values are
    left out (TOML has no null)."""
    out = [f"# {line}".rstrip() for line in header.splitlines()]
    _table(doc, [], out)
    return "\n".join(out).lstrip("\n") + "\n"


__all__ = ["dumps"]
