"""Helpers shared by CLI commands: `--json` output and repeatable KEY=VALUE flags."""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson

from libra.errors import ConfigError


def output_file(path: str | Path, flag: str) -> Path:
    """`path` as a file a command may write, its folder made; else a `ConfigError` naming
    `flag` (a folder, `""`, a path under a file or where this user cannot write were
    tracebacks, some after the work was done)."""
    if not str(path).strip():
        raise ConfigError(f"{flag} names no file; give a file path")
    # A link is followed (its target is written, as `open` would), and only a regular
    # file is replaced: the file is written beside and renamed over (`replaced`), which
    # turned a link into a file and, as root, a device such as /dev/null into one.
    p = Path(os.path.realpath(path))
    if p.is_dir():
        raise ConfigError(f"{flag} {str(path)!r} is a folder; give a file path in it")
    if p.exists() and not p.is_file():
        raise ConfigError(f"{flag} {str(path)!r} is not a regular file (a device or a pipe); "
                          "give a file path")  # fmt: skip
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = e.strerror or e
        raise ConfigError(
            f"{flag} {str(p)!r}: its folder cannot be made ({why}); give a path this user can write"
        ) from None
    if not os.access(p.parent, os.W_OK):
        raise ConfigError(f"{flag} {str(p)!r}: its folder is not writable; give a path "
                          "this user can write")  # fmt: skip
    return p


@contextlib.contextmanager
def replaced(out: Path, opener: Callable[..., Any] = open) -> Iterator[Any]:
    """A binary file to write that becomes `out` when the block ends well: written
    beside it and renamed, so a failure part way leaves `out` as it was."""
    part = out.with_name(f".{out.name}.part")
    try:
        with opener(part, "wb") as f:
            yield f
        part.replace(out)
    finally:
        part.unlink(missing_ok=True)


def add_json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")


JSON_OUT: contextvars.ContextVar[Any] = contextvars.ContextVar("libra_json_out", default=None)
"""Where `print_json` writes when `libra.cli.main` has pointed `sys.stdout` elsewhere."""


def print_json(doc: Any) -> None:
    out = JSON_OUT.get() or sys.stdout
    out.buffer.write(
        orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY) + b"\n"
    )
    out.flush()


@contextlib.contextmanager
def json_stdout() -> Iterator[None]:
    """For a `--json` command: stdout holds the one JSON document, so what anything else
    prints meanwhile (an env's `print` in a tool or reward) goes to stderr."""
    token = JSON_OUT.set(sys.stdout)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        JSON_OUT.reset(token)


def parse_pairs(values: list[str] | None, flag: str, example: str) -> list[tuple[str, str]]:
    """`["a=b", ...]` -> [("a", "b")]; a malformed item is a ConfigError."""
    out = []
    for item in values or []:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ConfigError(f"{flag} {item!r}: expected {example}")
        out.append((key.strip(), value.strip()))
    return out


def _int_at_least(text: str, least: int) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}") from None
    if n < least:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {n}")
    return n


def nonnegative(text: str) -> int:
    """An argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


seed = nonnegative
"""An argparse type for seeds (numpy's generators take no negative one)."""


def count(text: str) -> int:
    """An argparse `type` for a count flag: an integer >= 1 (argparse names the flag)."""
    return _int_at_least(text, 1)


def int_list(text: str, flag: str, least: int | None = None, example: str = "") -> list[int]:
    """`--flag`'s comma-separated integers (each at least `least`), or one ConfigError
    naming the flag."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or (least is not None and min(values) < least):
        at_least = f" >= {least}" if least is not None else ""
        eg = f" (e.g. {flag} {example})" if example else ""
        raise ConfigError(f"{flag} {text!r}: expected integers{at_least} separated by commas{eg}")
    return values


CONFIG_KINDS = {
    "rollout": ("libra.rollout.config", "RolloutConfig"),
    "serve-rollout": ("libra.service.config", "ServiceConfig"),
    "train": ("libra.train.config", "TrainConfig"),
}
"""The commands that read a TOML config, and the class of each one's."""


@contextlib.contextmanager
def config_of(command: str, path: str | Path | None) -> Iterator[None]:
    """Around loading `command`'s config from `path`: a file written for another command
    (every top-level key is that command's, and some are not this one's) is one error
    that says so, not a line per key it does not know."""
    try:
        yield
    except ConfigError:
        hint = None if path is None else _other_kind(command, path)
        if hint is None:
            raise
        raise ConfigError(hint) from None


def _fields(command: str) -> set[str]:
    import importlib

    module, name = CONFIG_KINDS[command]
    return set(getattr(importlib.import_module(module), name).model_fields)


def _other_kind(command: str, path: str | Path) -> str | None:
    from libra.config import read_toml

    try:
        keys = set(read_toml(path))
    except ConfigError:
        return None
    foreign = sorted(keys - _fields(command))
    if not foreign:
        return None
    for other in CONFIG_KINDS:
        if other != command and keys <= _fields(other):
            shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
            return (f"{path} is a `libra {other}` config, not a `libra {command}` one "
                    f"({shown}: {other}'s keys); run `libra {other} {path}`")  # fmt: skip
    return None


def add_set_flag(p: argparse.ArgumentParser, example: str) -> None:
    """`--set KEY=VALUE` (repeatable): any key of the command's config, VALUE in TOML."""
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override any config key, VALUE in TOML (repeatable): "
                   f"{example}")  # fmt: skip


def set_pairs(pairs: list[str]) -> list[tuple[str, Any]]:
    """`--set KEY=VALUE` pairs; VALUE is read as TOML (`false`, `4`, `"x"`, `[1, 2]`),
    or taken as a plain string when it is not TOML (`--set out=runs/a`)."""
    import tomllib

    out = []
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {pair}: expected KEY=VALUE, e.g. --set planner.adapt=false")
        if not all(part.strip() for part in key.split(".")):
            raise ConfigError(f"--set {pair}: the key {key.strip()!r} has an empty part; keys "
                              "are dotted names, e.g. --set planner.adapt=false")  # fmt: skip
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        out.append((key.strip(), value))
    return out


def overrides(sets: list[str], flags: dict[str, Any]) -> dict[str, Any]:
    """Config overrides (dotted keys): the `--set` pairs, then the dedicated flags given
    (a flag left unset does not undo a `--set` of its key: `--set steps=3` without
    `--steps` sets `steps`; given both, the flag wins)."""
    return dict(set_pairs(sets)) | {k: v for k, v in flags.items() if v is not None}


def routing_options(pairs: list[str] | None) -> dict[str, Any]:
    """`--routing KEY=VALUE` flags as a routing table: a value that parses as JSON is
    that (numbers, booleans), any other a string (a path, a mode name)."""
    out: dict[str, Any] = {}
    for key, raw in parse_pairs(pairs, "--routing", "KEY=VALUE, e.g. min_samples=8"):
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def add_fleet_flags(p: argparse.ArgumentParser) -> None:
    """Flags every job that talks to buckets of endpoints shares (rollout, serve-rollout,
    train): model, routing policy, endpoints and buckets, sampling and limits."""
    p.add_argument("--model", help="model folder (default: the tiny default model)")
    p.add_argument("--policy", help="routing policy (cmlfq, mlfq, predictor, static)")
    p.add_argument(
        "--endpoint", action="append", metavar="BUCKET=URL", help="add an endpoint (repeatable)"
    )
    p.add_argument(
        "--bucket", action="append", metavar="NAME=TP:BOUND", help="declare a bucket (repeatable)"
    )
    p.add_argument("--launch", type=nonnegative, metavar="N", help="engines to start per bucket")
    p.add_argument("--launch-kind", choices=("embedded", "vllm"),
                   help="what --launch starts: embedded engines (default) or vLLM servers at "
                   "each bucket's TP size ([launch.vllm] or LIBRA_VLLM_PYTHON names the "
                   "interpreter)")  # fmt: skip
    p.add_argument("--temperature", type=float, help="sampling temperature")
    p.add_argument("--max-tokens", type=int, help="tokens per model turn")
    p.add_argument("--max-turns", type=int, help="override the env's max_turns")
    p.add_argument("--max-context", type=int, help="largest total context per episode")


def add_ray_flag(p: argparse.ArgumentParser) -> None:
    """`--ray [ADDRESS]`: the engines `--launch` starts are placed by Ray (jobs that start
    engines but have no `[cluster]` table of their own to set)."""
    p.add_argument("--ray", nargs="?", const="auto", metavar="ADDRESS",
                   help="start the launched engines in Ray actors on the nodes of the Ray "
                   "cluster at ADDRESS (default auto: the one `ray start` runs here; "
                   "HOST:PORT or ray://HOST:PORT); needs pip install 'libra-rl[ray]'")  # fmt: skip


def ray_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Config overrides from `--ray`."""
    if args.ray is None:
        return {}
    if args.ray.endswith(".toml"):  # `--ray CONFIG`: argparse gave the config to --ray
        raise ConfigError(
            f"--ray took {args.ray!r} as the Ray cluster's address; put the config first "
            f"(`{args.ray} --ray` or `{args.ray} --ray HOST:PORT`)"
        )
    return {"cluster.backend": "ray", "cluster.address": args.ray}


def fleet_overrides(args: argparse.Namespace, prefix: str = "") -> dict[str, Any]:
    """Config overrides (dotted keys) from `add_fleet_flags`; `prefix` places them under a
    table (e.g. `rollout.`)."""
    keys = {
        "model": args.model,
        "policy": args.policy,
        "sampling.temperature": args.temperature,
        "sampling.max_tokens": args.max_tokens,
        "limits.max_turns": args.max_turns,
        "limits.max_context": args.max_context,
        "launch.kind": args.launch_kind,
    }
    return {prefix + k: v for k, v in keys.items()}


def apply_bucket_flags(cfg: Any, args: argparse.Namespace) -> None:
    """Merge `--endpoint` / `--bucket` / `--launch` into `cfg.buckets`."""
    from libra.endpoints.config import BucketConfig
    from libra.rollout.serving import merge_bucket_flags

    endpoints = parse_pairs(args.endpoint, "--endpoint", "BUCKET=URL")
    bucket_flags = parse_pairs(args.bucket, "--bucket", "NAME=TP:BOUND")
    if endpoints or bucket_flags:
        cfg.buckets = merge_bucket_flags(cfg.buckets, endpoints, bucket_flags)
    if args.launch is not None:
        if not cfg.buckets:
            cfg.buckets = [BucketConfig(name="tp1", tp=1)]
        for b in cfg.buckets:
            b.launch = args.launch
