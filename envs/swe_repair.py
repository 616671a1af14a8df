"""`swe-repair`: fix an injected bug in a real Python project (R2E-Gym style).

Each episode gets its own sandbox (image `python`: Debian + python3 + pytest) holding a
copy of the project with one line of library code mutated; some of the project's own
tests now fail. The model reads and edits files and runs tests with `bash`, `view`,
`edit`, then calls `submit` (or answers). Reward 1 when, with the original test files
restored (so editing tests does not pay), the tests that the bug broke pass again and
at least as many tests pass as in the pristine project; else 0. `reward_info` says
which part failed.

Tasks (`data/swe_repair.jsonl`) come from `data/make_swe_repair.py`, which mutates the
projects in `swe_projects.PROJECTS` and keeps bugs that break 1-30 tests.

A task is untrusted input (a `libra serve-rollout` client writes it): `check_task` accepts
only a listed project, one of that project's listed library files (`Project.sources`),
and fields of the right types and sizes, before anything touches a file; `prompt` runs
it, so a bad task is refused at submit with the field and the fix. Files are read in a
worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from libra.envs.swe_projects import PROJECTS, Mutation, run_tests, source_dir
from libra.sandboxes import open_backend
from libra.sandboxes.base import Backend, SandboxSpec
from libra.tools.files import edit, view
from libra.tools.shell import bash
from libra.tools.submit import submit

import libra
from libra.errors import EnvError

ROOT = "/work"
SYSTEM = (
    "You are a software engineer fixing a bug in a Python project. Use the tools to "
    "read files, edit them and run the tests. Fix the library code, not the tests. "
    "When the failing tests pass, call submit."
)


MAX_TEXT = 1000
"""Longest `before` / `after` line and test id a task may carry."""
MAX_TESTS = 1000


def project_root(task: dict[str, Any]) -> str:
    return f"{ROOT}/{task['project']}"


def check_task(task: dict[str, Any]) -> None:
    """Refuse a task that names anything but a listed project's listed library file, or
    whose fields have the wrong type or size (`EnvError` naming the field and the fix)."""
    project = PROJECTS.get(task.get("project")) if isinstance(task.get("project"), str) else None
    if project is None:
        raise EnvError(
            f"swe-repair: task['project'] = {task.get('project')!r:.80} is not one of "
            f"{', '.join(PROJECTS)}; tasks come from data/swe_repair.jsonl"
        )
    if task.get("file") not in project.sources:
        raise EnvError(
            f"swe-repair: task['file'] = {task.get('file')!r:.80} is not a library file of "
            f"{project.name} ({', '.join(project.sources)}); a bug is injected only there"
        )
    line = task.get("line")
    if type(line) is not int or not 1 <= line <= 100_000:
        raise EnvError(f"swe-repair: task['line'] = {line!r:.40} must be a line number >= 1")
    for key in ("before", "after"):
        text = task.get(key)
        if not isinstance(text, str) or len(text) > MAX_TEXT or "\n" in text or "\r" in text:
            raise EnvError(
                f"swe-repair: task[{key!r}] must be one line of text (at most {MAX_TEXT} "
                "characters)"
            )
    tests = task.get("fail_to_pass")
    if (
        not isinstance(tests, list)
        or not 1 <= len(tests) <= MAX_TESTS
        or not all(isinstance(t, str) and len(t) <= MAX_TEXT for t in tests)
    ):
        raise EnvError(
            f"swe-repair: task['fail_to_pass'] must be a list of 1-{MAX_TESTS} test ids (strings)"
        )
    passed = task.get("pristine_passed")
    if type(passed) is not int or passed < 0:
        raise EnvError("swe-repair: task['pristine_passed'] must be an integer >= 0")


class SweRepair(libra.Env):
    """Code repair in a sandbox; options: `backend` (auto | docker | bwrap),
    `memory_mb`, `test_timeout_s`."""

    tools = [bash, view, edit, submit]
    max_turns = 16
    tasks_file = "data/swe_repair.jsonl"

    def __init__(
        self,
        backend: str = "auto",
        memory_mb: int = 1024,
        test_timeout_s: float = 300.0,
        **options: Any,
    ):
        super().__init__(
            backend=backend, memory_mb=memory_mb, test_timeout_s=test_timeout_s, **options
        )
        self.backend_name = backend
        self.spec = SandboxSpec(image="python", workdir=ROOT, memory_mb=memory_mb, pids=512)
        self.test_timeout_s = test_timeout_s
        self._backend: Backend | None = None
        self._lock = asyncio.Lock()

    async def backend(self) -> Backend:
        """The run's sandbox backend, started on first use."""
        async with self._lock:
            if self._backend is None:
                self._backend = await open_backend(self.backend_name)
            return self._backend

    async def close(self) -> None:
        """Close every sandbox and the backend (the engine's end of run, if it calls it)."""
        if self._backend is not None:
            await self._backend.aclose()
            self._backend = None

    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        check_task(task)
        failing = task["fail_to_pass"]
        shown = "\n".join(f"- {t}" for t in failing[:8])
        more = f"\n(and {len(failing) - 8} more)" if len(failing) > 8 else ""
        project = PROJECTS[task["project"]]
        user = (
            f"The repository {project_root(task)} holds {project.name} {project.version}. "
            f"A bug makes these tests fail:\n{shown}{more}\n\n"
            f"Run them with `cd {project_root(task)} && python3 -m pytest -q "
            f"{' '.join(project.tests)}`. Find and fix the bug, then call submit."
        )
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]

    async def setup(self, ctx: libra.Context) -> None:
        task = ctx.task
        check_task(task)  # before anything is read or created
        project = PROJECTS[task["project"]]
        src = await asyncio.to_thread(source_dir, project)
        mutation = Mutation(task["file"], task["line"], task["before"], task["after"], "")
        mutated = await asyncio.to_thread(_mutated, src / task["file"], mutation)
        sb = await (await self.backend()).create(self.spec)
        ctx.sandbox = sb
        root = project_root(task)
        await sb.copy_in(src, root)
        await sb.write_file(f"{root}/{task['file']}", mutated)

    async def teardown(self, ctx: libra.Context) -> None:
        if ctx.sandbox is not None:
            await ctx.sandbox.close()

    async def reward(  # type: ignore[override]  # Env.reward may take the context
        self, task: dict[str, Any], trajectory: libra.Trajectory, ctx: libra.Context
    ) -> Any:
        sb = ctx.sandbox
        if sb is None:
            return 0.0, {"error": "no sandbox"}
        return await judge(sb, task, self.test_timeout_s)


def _mutated(path: Path, mutation: Mutation) -> str:
    """The library file with the bug in it (blocking: a worker thread reads it)."""
    return mutation.apply(path.read_text())


async def judge(sb: Any, task: dict[str, Any], timeout_s: float = 300.0) -> tuple[float, dict]:
    """Restore the original tests, run the suite, score it (see the module docstring)."""
    check_task(task)
    project = PROJECTS[task["project"]]
    src = await asyncio.to_thread(source_dir, project)
    root = project_root(task)
    for t in project.tests:
        await sb.copy_in(Path(src) / t, f"{root}/{t}")
    run = await run_tests(sb, root, list(project.tests), timeout=timeout_s)
    fixed = [t for t in task["fail_to_pass"] if t in run.passed]
    ok = (
        not run.timed_out
        and len(fixed) == len(task["fail_to_pass"])
        and len(run.passed) >= task["pristine_passed"]
    )
    info = {
        **run.info(),
        "fail_to_pass_fixed": len(fixed),
        "fail_to_pass": len(task["fail_to_pass"]),
        "pristine_passed": task["pristine_passed"],
    }
    return float(ok), info


__all__ = ["SweRepair", "check_task", "judge"]
