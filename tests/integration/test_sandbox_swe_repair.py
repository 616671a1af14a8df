"""swe-repair end to end in a real sandbox: the injected bug fails its tests, the tools
fix it, and the reward tells a fix from no fix and from a test-tampering cheat."""

from __future__ import annotations

import pytest
from libra.envs.loading import load_records
from libra.envs.swe_projects import PROJECTS
from libra.envs.swe_repair import SweRepair, project_root
from libra.tools.files import edit, view
from libra.tools.shell import bash
from libra.tools.submit import submit

import libra
from tests.conftest import need

BACKENDS = ["bwrap", pytest.param("docker", marks=pytest.mark.docker)]


def available(name: str) -> None:
    if name == "docker":
        from libra.sandboxes.docker import engine_answers

        why = engine_answers()
    else:
        from libra.sandboxes.bwrap import BwrapBackend

        why = BwrapBackend.available()
    need(why is None, f"{name} unavailable: {why}")


@pytest.mark.slow
@pytest.mark.parametrize("backend_name", BACKENDS)
async def test_fix_scores_one_no_fix_and_cheat_score_zero(backend_name: str) -> None:
    available(backend_name)
    env = SweRepair(backend=backend_name, test_timeout_s=120)
    task = next(t for t in load_records(env.default_tasks()) if t["project"] == "inflection")
    ctx = libra.Context("swe-test", task, env=env)
    traj = libra.Trajectory(
        id="t", batch_id="b", task_id=task["id"], group_id="g", env="swe-repair"
    )
    root = project_root(task)
    tests = " ".join(PROJECTS["inflection"].tests)
    await env.setup(ctx)
    try:
        run = await bash.invoke(
            {"command": f"cd {root} && python3 -m pytest -q {tests}", "timeout": 120}, ctx
        )
        assert run.status == "error" and "failed" in run.content  # the bug bites

        reward, info = await env.reward(task, traj, ctx)
        assert reward == 0.0 and info["fail_to_pass_fixed"] == 0

        # A cheat: a conftest that deselects every test. Fewer tests pass: no reward.
        cheat = "def pytest_collection_modifyitems(items):\n    items.clear()\n"
        made = await edit.invoke({"path": f"{root}/conftest.py", "old": "", "new": cheat}, ctx)
        assert made.status == "ok"
        reward, info = await env.reward(task, traj, ctx)
        assert reward == 0.0 and info["tests_passed"] == 0
        await bash.invoke({"command": f"rm {root}/conftest.py"}, ctx)

        shown = await view.invoke(
            {
                "path": f"{root}/{task['file']}",
                "start_line": task["line"],
                "end_line": task["line"],
            },
            ctx,
        )
        assert task["after"].strip() in shown.content
        fixed = await edit.invoke(
            {"path": f"{root}/{task['file']}", "old": task["after"], "new": task["before"]}, ctx
        )
        assert fixed.status == "ok", fixed.content
        assert (await submit.invoke({}, ctx)).status == "ok"
        reward, info = await env.reward(task, traj, ctx)
        assert reward == 1.0, info
        assert info["tests_passed"] >= task["pristine_passed"]
    finally:
        await env.teardown(ctx)
        await env.close()
    assert ctx.sandbox.closed
