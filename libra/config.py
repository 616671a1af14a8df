"""Typed configs: pydantic v2 models loaded from TOML, overridden by flags.

Every component owns a small `Config` subclass whose field docstrings are its
documentation. Unknown keys are errors; a bad value fails at load time with the
field's path and the file in the message, e.g.

    examples/cpu.toml: rollout.concurrency: Input should be greater than 0 (got -1)
"""

from __future__ import annotations

import functools
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from libra.errors import ConfigError

C = TypeVar("C", bound="Config")


class Config(BaseModel):
    """Base of every config: strict keys, field docstrings become descriptions, and
    strict scalars: a number field takes a number (`steps = true` and `steps = "10"`
    are errors, not 1 and 10), a boolean field `true` or `false` (not `"no"` or 0)."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True
    )

    def public(self) -> dict[str, Any]:
        """The config as JSON data with its secrets (`SECRETS`) replaced by a mark: what
        may be written to a run folder (world-readable under the usual umask) or sent to
        a tracker."""
        return _redact(self.model_dump(mode="json"))

    @field_validator("*", mode="before")
    @classmethod
    def _strict_scalar(cls, v: Any, info: ValidationInfo) -> Any:
        kind = _scalar_kind(cls, info.field_name) if info.field_name else None
        if kind is None or v is None:
            return v
        if kind is bool:
            if not isinstance(v, bool):
                raise PydanticCustomError("strict_bool", "expected true or false")
        elif isinstance(v, bool):
            raise PydanticCustomError("strict_number", "expected a number, not true/false")
        elif isinstance(v, str):
            raise PydanticCustomError(
                "strict_number", 'expected a number, not a string (write 4, not "4")'
            )
        return v


SECRETS = frozenset({"api_key"})
"""Config keys whose values are secrets (at any depth)."""
REDACTED = "<set; not saved>"


def _redact(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: (REDACTED if k in SECRETS and v is not None else _redact(v))
                for k, v in data.items()}  # fmt: skip
    if isinstance(data, list):
        return [_redact(v) for v in data]
    return data


def without_secrets(data: Any) -> Any:
    """`data` (a config as JSON data) with every secret key left out."""
    if isinstance(data, dict):
        return {k: without_secrets(v) for k, v in data.items() if k not in SECRETS}
    if isinstance(data, list):
        return [without_secrets(v) for v in data]
    return data


@functools.cache
def _scalar_kind(cls: type[Config], name: str) -> type | None:
    """int, float or bool when field `name` of `cls` is that type (or it or None), else
    None (a union with other types, a string, a model: pydantic's own rules apply)."""
    field = cls.model_fields.get(name)
    if field is None:
        return None
    ann = field.annotation
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) != 1:
            return None
        ann = args[0]
    return typing.cast(type, ann) if ann in (int, float, bool) else None


def format_validation_error(err: ValidationError, source: str = "") -> str:
    """One line per problem: `source: a.b.c: message (got value)`; joined with '; '."""
    parts = []
    for e in err.errors():
        msg = e["msg"]
        if not e["loc"] and e["type"] == "value_error":
            # a check across fields: its message names them; its input is the whole document
            parts.append(msg.removeprefix("Value error, "))
            continue
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            msg = "unknown key (remove it or check the spelling)"
        got = e.get("input")
        shown = "" if e["type"] in ("missing", "extra_forbidden") else f" (got {got!r:.200})"
        parts.append(f"{loc}: {msg}{shown}")
    prefix = f"{source}: " if source else ""
    return prefix + "; ".join(parts)


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {str(p)!r} not found; pass an existing .toml file")
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} is not a file; pass a .toml file")
    try:
        with open(p, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {e.start}); TOML files are UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot be read ({e.strerror or e})") from None


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `a.b.c = value` inside nested dicts, creating levels as needed."""
    *parents, leaf = dotted.split(".")
    cur = data
    for key in parents:
        nxt = cur.setdefault(key, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"cannot set {dotted!r}: {key!r} is not a table")
        cur = nxt
    cur[leaf] = value


def build(cls: type[C], data: dict[str, Any], source: str = "") -> C:
    """Validate `data` into `cls`, turning a ValidationError into one ConfigError line."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source)) from None


def load(
    cls: type[C], path: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> C:
    """Load `cls` from a TOML file (optional), then apply dotted-key overrides from flags."""
    data: dict[str, Any] = read_toml(path) if path is not None else {}
    for key, value in (overrides or {}).items():
        if value is not None:
            set_dotted(data, key, value)
    return build(cls, data, str(path) if path is not None else "")


__all__ = [
    "SECRETS",
    "Config",
    "build",
    "format_validation_error",
    "load",
    "read_toml",
    "set_dotted",
    "without_secrets",
]
