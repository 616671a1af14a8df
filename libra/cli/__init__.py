"""`libra` command line. Each command lives in its own module under `libra.cli` and
exposes `add_parser(subparsers)` and `run(args) -> int`; modules import heavy
dependencies inside `run`, so `libra --help` stays fast.

Bad input exits 2 with one line `libra: error: ...` naming the problem and the fix,
never a traceback. `--json` prints one JSON document on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from libra import usercode
from libra.errors import LibraError, disk_full, full_reason

# name -> module. Add a line when a command lands (and only then: no stubs).
COMMANDS: dict[str, str] = {
    "rollout": "libra.cli.rollout",
    "envs": "libra.cli.registry_cmds",
    "tools": "libra.cli.registry_cmds",
    "bench": "libra.cli.bench",
    "workload": "libra.cli.workload",
    "eval-routing": "libra.cli.eval_routing",
    "make-model": "libra.cli.make_model",
    "serve-rollout": "libra.cli.serve_rollout",
    "serve-engine": "libra.cli.serve_engine",
    "plan": "libra.cli.plan",
    "profile": "libra.cli.profile",
    "simulate": "libra.cli.simulate",
    "train": "libra.cli.train",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse's default prints the whole usage block; keep it to one line + hint.
        self.exit(2, f"libra: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="libra",
        description="Libra: adaptive runtime for agentic RL post-training.",
    )
    from libra import __version__

    parser.add_argument("--version", action="version", version=f"libra {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = module.add_parser(sub, name)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    code = _main(argv)
    if usercode.overruns():
        # User code stuck past its limit keeps a thread that cannot be killed, and the
        # interpreter joins every pool thread at exit: it would never exit.
        print(f"libra: {usercode.overruns()} calls of user code were still running past "
              "their limits; exiting without them", file=sys.stderr)  # fmt: skip
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        if getattr(args, "json", False):
            from libra.cli.common import json_stdout

            with json_stdout():
                return int(args._run(args) or 0)
        return int(args._run(args) or 0)
    except LibraError as e:
        print(f"libra: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("libra: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `libra ... | head`: the reader left. Python's recipe: point stdout at devnull
        # so that the flush at exit does not raise again; exit as a shell would (SIGPIPE).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:
        if (full := disk_full(e)) is None:
            raise
        print(f"libra: error: {full_reason(full)}; free space and try again", file=sys.stderr)
        return 2


__all__ = ["COMMANDS", "build_parser", "main"]
