"""Helpers shared by CLI commands: `--json` output and repeatable KEY=VALUE flags."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import orjson

from libra.errors import ConfigError


def add_json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def print_json(doc: Any) -> None:
    sys.stdout.buffer.write(
        orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY) + b"\n"
    )
    sys.stdout.flush()


def parse_pairs(values: list[str] | None, flag: str, example: str) -> list[tuple[str, str]]:
    """`["a=b", ...]` -> [("a", "b")]; a malformed item is a ConfigError."""
    out = []
    for item in values or []:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ConfigError(f"{flag} {item!r}: expected {example}")
        out.append((key.strip(), value.strip()))
    return out


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
