"""The real projects behind `swe-repair`, their bugs, and how their tests are judged.

Projects are PyPI source distributions that ship their own test suites, pinned by
version and sha256 and fetched once with `pip download` into
`$LIBRA_CACHE/swe/<name>-<version>` (`python -m libra.envs.swe_projects fetch`).
A bug is one mutation of one line of library code (an operator, a boolean, an
off-by-one), found by `mutations()` and kept by the generator when it makes some of the
project's own tests fail (`data/make_swe_repair.py`).

Judging (`run_tests`): pytest with a JUnit report inside the sandbox, under a timeout and
with capped output; the report, not the console, decides which tests passed.
"""

from __future__ import annotations

import ast
import hashlib
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libra.sandboxes.base import Sandbox
from libra.sandboxes.images import cache_dir

from libra.errors import EnvError


@dataclass(frozen=True, slots=True)
class Project:
    name: str
    version: str
    sha256: str
    licence: str
    tests: tuple[str, ...]
    """Test paths (relative to the project root), restored before judging."""
    sources: tuple[str, ...]
    """Library files bugs are injected into."""

    @property
    def dirname(self) -> str:
        return f"{self.name}-{self.version}"


PROJECTS: dict[str, Project] = {
    p.name: p
    for p in (
        Project(
            "toolz",
            "1.2.0",
            "9667a038e9d6ecba37995e26cb2f59ec6420b6ad8dd9677de59db9b956b08490",
            "BSD-3-Clause",
            ("toolz/tests",),
            ("toolz/itertoolz.py", "toolz/dicttoolz.py", "toolz/functoolz.py", "toolz/recipes.py"),
        ),
        Project(
            "inflection",
            "0.5.1",
            "1a29730d366e996aaacffb2f1f1cb9593dc38e2ddd30c91250c6dde09ea9b417",
            "MIT",
            ("test_inflection.py",),
            ("inflection/__init__.py",),
        ),
        Project(
            "tabulate",
            "0.10.0",
            "e2cfde8f79420f6deeffdeda9aaec3b6bc5abce947655d17ac662b126e48a60d",
            "MIT",
            ("test",),
            ("tabulate/__init__.py",),
        ),
        Project(
            "boltons",
            "26.2.0",
            "d39cfd15c1a1c3bd4d705c82252fa9edb8e4f5e8cc039f8e39afac7b1b47e92c",
            "BSD-3-Clause",
            ("tests",),
            ("boltons/strutils.py", "boltons/iterutils.py", "boltons/listutils.py"),
        ),
    )
}


def source_dir(project: Project) -> Path:
    """The unpacked source tree on the host, fetched from PyPI on first use (blocking)."""
    root = cache_dir() / "swe"
    target = root / project.dirname
    if (target / ".libra-complete").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
            tmp,
            f"{project.name}=={project.version}",
        ]
        try:  # a bounded wait: this runs in a worker thread nobody can kill
            done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600)
        except subprocess.TimeoutExpired:
            raise EnvError(
                f"swe-repair: fetching {project.dirname} from PyPI took over 600 s; "
                f"fetch it ahead with `python -m libra.envs.swe_projects fetch {project.name}`"
            ) from None
        archives = list(Path(tmp).glob(f"{project.name}-{project.version}.tar.gz"))
        if done.returncode != 0 or not archives:
            raise EnvError(
                f"swe-repair: cannot fetch {project.dirname} from PyPI: "
                f"{done.stderr.strip()[-300:]}"
            )
        digest = hashlib.sha256(archives[0].read_bytes()).hexdigest()
        if digest != project.sha256:
            raise EnvError(
                f"swe-repair: {archives[0].name} has sha256 {digest}, expected {project.sha256}"
            )
        with tarfile.open(archives[0]) as tar:
            tar.extractall(tmp, filter="data")
        unpacked = Path(tmp) / project.dirname
        (unpacked / ".libra-complete").touch()
        if not target.exists():
            os.rename(unpacked, target)
    return target


# --- bugs -------------------------------------------------------------------------

_SWAPS: dict[type, str] = {
    ast.Lt: "<=",
    ast.LtE: "<",
    ast.Gt: ">=",
    ast.GtE: ">",
    ast.Eq: "!=",
    ast.NotEq: "==",
    ast.Add: "-",
    ast.Sub: "+",
    ast.And: "or",
    ast.Or: "and",
}
_TOKENS: dict[type, str] = {
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Add: "+",
    ast.Sub: "-",
    ast.And: "and",
    ast.Or: "or",
}


@dataclass(frozen=True, slots=True)
class Mutation:
    file: str
    line: int
    """1-based line number."""
    before: str
    after: str
    kind: str

    def apply(self, text: str) -> str:
        lines = text.splitlines(keepends=True)
        if not 1 <= self.line <= len(lines):
            raise EnvError(f"{self.file} has {len(lines)} lines, not a line {self.line}")
        if lines[self.line - 1].rstrip("\n") != self.before:
            raise EnvError(f"{self.file}:{self.line} does not read {self.before!r}")
        lines[self.line - 1] = self.after + "\n"
        return "".join(lines)


def _swap_token(line: str, start: int, end: int, old: str, new: str) -> str | None:
    """Replace the single occurrence of operator `old` in line[start:end]."""
    span = line[start:end]
    padded = f" {old} "
    if span.count(padded) != 1:
        return None
    return line[:start] + span.replace(padded, f" {new} ") + line[end:]


def mutations(path: str, text: str) -> Iterator[Mutation]:
    """Single-line bug candidates in a module's functions (not in docstrings)."""
    tree = ast.parse(text)
    lines = text.splitlines()
    seen: set[tuple[int, str]] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            lineno = getattr(node, "lineno", None)
            if lineno is None or getattr(node, "end_lineno", None) != lineno:
                continue
            line = lines[lineno - 1]
            start, end = node.col_offset, node.end_col_offset  # type: ignore[attr-defined]
            out: list[tuple[str, str]] = []
            op: type
            if isinstance(node, ast.Compare) and len(node.ops) == 1:
                op = type(node.ops[0])
                if op in _SWAPS:
                    swapped = _swap_token(line, start, end, _TOKENS[op], _SWAPS[op])
                    out.append((f"compare {_TOKENS[op]}", swapped or ""))
            elif isinstance(node, ast.BinOp) and type(node.op) in _SWAPS:
                op = type(node.op)
                out.append(
                    (
                        f"arith {_TOKENS[op]}",
                        _swap_token(line, start, end, _TOKENS[op], _SWAPS[op]) or "",
                    )
                )
            elif isinstance(node, ast.BoolOp) and len(node.values) == 2:
                op = type(node.op)
                out.append(
                    (
                        f"bool {_TOKENS[op]}",
                        _swap_token(line, start, end, _TOKENS[op], _SWAPS[op]) or "",
                    )
                )
            elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
                inner = line[start:end]
                if inner.startswith("not "):
                    out.append(("drop not", line[:start] + inner[4:] + line[end:]))
            elif (
                isinstance(node, ast.Constant)
                and type(node.value) is int
                and 0 <= node.value <= 2
                and line[start:end] == str(node.value)
            ):
                out.append(("off by one", f"{line[:start]}{node.value + 1}{line[end:]}"))
            for kind, new in out:
                if new and new != line and (lineno, new) not in seen:
                    seen.add((lineno, new))
                    yield Mutation(path, lineno, line, new, kind)


# --- judging ------------------------------------------------------------------------

JUNIT = "/tmp/libra-junit.xml"


@dataclass(frozen=True, slots=True)
class TestRun:
    passed: frozenset[str]
    failed: frozenset[str]
    """Failed or errored tests."""
    skipped: int
    timed_out: bool
    exit_code: int

    def info(self) -> dict[str, Any]:
        return {
            "tests_passed": len(self.passed),
            "tests_failed": len(self.failed),
            "tests_skipped": self.skipped,
            "timed_out": self.timed_out,
        }


def parse_junit(xml: bytes) -> tuple[set[str], set[str], int]:
    passed, failed, skipped = set(), set(), 0
    for case in ET.fromstring(xml).iter("testcase"):
        tid = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.add(tid)
        elif case.find("skipped") is not None:
            skipped += 1
        else:
            passed.add(tid)
    return passed, failed, skipped


async def run_tests(
    sb: Sandbox,
    root: str,
    tests: list[str],
    timeout: float = 300.0,  # noqa: ASYNC109
) -> TestRun:
    """Run pytest on `tests` inside the sandbox; the JUnit report decides."""
    await sb.exec(["rm", "-f", JUNIT], timeout=30)
    args = " ".join(shlex.quote(t) for t in tests)
    r = await sb.exec(
        f"python3 -m pytest -q -p no:cacheprovider --tb=no -o junit_family=xunit1 "
        f"--junitxml={JUNIT} {args}",
        cwd=root,
        timeout=timeout,
        max_output=16 * 1024,
    )
    try:
        passed, failed, skipped = parse_junit(await sb.read_file(JUNIT))
    except (FileNotFoundError, ET.ParseError):
        passed, failed, skipped = set(), set(), 0
    return TestRun(frozenset(passed), frozenset(failed), skipped, r.timed_out, r.exit_code)


def main(argv: list[str] | None = None) -> int:
    names = argv if argv is not None else sys.argv[2:]
    if (sys.argv[1:2] != ["fetch"] and argv is None) or not set(names) <= set(PROJECTS):
        print(f"usage: python -m libra.envs.swe_projects fetch [{' '.join(PROJECTS)}]")
        return 2
    for name in names or PROJECTS:
        print(f"{name}: {source_dir(PROJECTS[name])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "PROJECTS",
    "Mutation",
    "Project",
    "TestRun",
    "mutations",
    "parse_junit",
    "run_tests",
    "source_dir",
]
