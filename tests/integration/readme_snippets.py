"""The README's code as a user pastes it: fenced blocks split into shell commands and
Python scripts, run in a scratch folder with `libra` on the PATH.

A `bash` block is one snippet per command (continuation lines joined, comments kept:
bash ignores them); a `python` block is one script, written as the file its first line
names (`# my_envs.py`) so that later commands can import it, else as `snippet_L<line>.py`.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^```(\w*)\s*$")
MODULE = re.compile(r"^# (\w+\.py)\s*$")


@dataclass(frozen=True, slots=True)
class Snippet:
    kind: str
    """`bash` or `python`."""
    line: int
    """README line of its first code line."""
    text: str

    def __str__(self) -> str:
        first = self.text.strip().splitlines()[0]
        return f"README.md:{self.line}: {first[:90]}"

    @property
    def module(self) -> str | None:
        """The file a Python snippet names on its first line (`# my_agent.py`)."""
        m = MODULE.match(self.text.splitlines()[0]) if self.kind == "python" else None
        return m.group(1) if m else None


def snippets(readme: Path) -> list[Snippet]:
    out: list[Snippet] = []
    lang, start, body = None, 0, []
    for n, line in enumerate(readme.read_text().splitlines(), 1):
        m = FENCE.match(line)
        if m and lang is None:
            lang, start, body = m.group(1) or "text", n + 1, []
        elif m:
            if lang == "python":
                out.append(Snippet("python", start, "\n".join(body) + "\n"))
            elif lang == "bash":
                out += _commands(start, body)
            lang = None
        elif lang is not None:
            body.append(line)
    return out


def _commands(start: int, lines: list[str]) -> list[Snippet]:
    out, parts, first = [], [], 0
    for i, line in enumerate(lines):
        if not parts and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if not parts:
            first = start + i
        parts.append(line[:-1] if line.endswith("\\") else line)
        if not line.endswith("\\"):
            out.append(Snippet("bash", first, " ".join(p.strip() for p in parts)))
            parts = []
    return out


def command(text: str, extra: str = "") -> str:
    """The shell command without its trailing comment, with `extra` flags appended (for
    argparse the last value of a flag wins)."""
    return shlex.join(shlex.split(text, comments=True) + shlex.split(extra))


def environment() -> dict[str, str]:
    """This interpreter's `bin` (where `libra` is installed) first on the PATH; no token
    or vLLM interpreter inherited from the caller."""
    env = {k: v for k, v in os.environ.items() if k not in ("LIBRA_TOKEN", "LIBRA_VLLM_PYTHON")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    return env


@dataclass(slots=True)
class Outcome:
    snippet: Snippet
    returncode: int
    output: str
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and "Traceback (most recent call last)" not in self.output


def run(s: Snippet, text: str, cwd: Path, extra: str = "", timeout: float = 300) -> Outcome:
    """Run one snippet to completion (`text`: its code, ports already mapped)."""
    if s.kind == "python":
        script = cwd / (s.module or f"snippet_L{s.line}.py")
        script.write_text(text)
        argv = [sys.executable, script.name]
    else:
        argv = ["bash", "-c", command(text, extra)]
    t0 = time.monotonic()
    try:
        r = subprocess.run(argv, cwd=cwd, env=environment(), capture_output=True, text=True,
                           timeout=timeout, check=False)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        return Outcome(s, -1, f"still running after {timeout:g} s: {e.stderr or ''}")
    return Outcome(s, r.returncode, r.stdout[-3000:] + r.stderr[-3000:], time.monotonic() - t0)


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False


__all__ = ["Outcome", "Snippet", "command", "environment", "ready", "run", "snippets"]
