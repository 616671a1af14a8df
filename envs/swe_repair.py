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

ROOT = "/work"
SYSTEM = (
    "You are a software engineer fixing a bug in a Python project. Use the tools to "
    "read files, edit them and run the tests. Fix the library code, not the tests. "
    "When the failing tests pass, call submit."
)


def project_root(task: dict[str, Any]) -> str:
    return f"{ROOT}/{task['project']}"


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
        project = PROJECTS[task["project"]]
        src = await asyncio.to_thread(source_dir, project)
        sb = await (await self.backend()).create(self.spec)
        ctx.sandbox = sb
        root = project_root(task)
        await sb.copy_in(src, root)
        mutation = Mutation(task["file"], task["line"], task["before"], task["after"], "")
        pristine = (src / task["file"]).read_text()
        await sb.write_file(f"{root}/{task['file']}", mutation.apply(pristine))

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


async def judge(sb: Any, task: dict[str, Any], timeout_s: float = 300.0) -> tuple[float, dict]:
    """Restore the original tests, run the suite, score it (see the module docstring)."""
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


__all__ = ["SweRepair", "judge"]
