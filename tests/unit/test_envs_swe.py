"""swe-repair's bug generator and test-report parsing (no sandbox needed)."""

from __future__ import annotations

import ast
import re

import pytest
from libra.envs.loading import load_records
from libra.envs.swe_projects import PROJECTS, Mutation, mutations, parse_junit
from libra.envs.swe_repair import SweRepair, check_task

import libra
from libra.errors import EnvError

SOURCE = '''
def clamp(x, lo, hi):
    """Keep x within [lo, hi] (the docstring is not code: 0 < 1 stays)."""
    if x < lo and not hi == 0:
        return lo
    return min(x + 0, hi)
'''


def test_mutations_change_one_line_into_valid_python() -> None:
    found = list(mutations("m.py", SOURCE))
    kinds = {m.kind for m in found}
    assert {"compare <", "bool and", "drop not", "compare ==", "arith +", "off by one"} <= kinds
    for m in found:
        mutated = m.apply(SOURCE)
        ast.parse(mutated)
        diff = [
            (a, b) for a, b in zip(SOURCE.splitlines(), mutated.splitlines(), strict=True) if a != b
        ]
        assert len(diff) == 1 and diff[0] == (m.before, m.after)
    assert all("docstring" not in m.before for m in found)


def test_a_mutation_refuses_a_file_that_changed() -> None:
    m = Mutation("m.py", 4, "    if x <= lo:", "    if x < lo:", "compare <=")
    with pytest.raises(EnvError, match="does not read"):
        m.apply(SOURCE)


def test_junit_report_decides_pass_and_fail() -> None:
    xml = b"""<testsuites><testsuite>
      <testcase classname="t.test_a" name="test_ok"/>
      <testcase classname="t.test_a" name="test_bad"><failure message="x"/></testcase>
      <testcase classname="t.test_a" name="test_err"><error message="y"/></testcase>
      <testcase classname="t.test_a" name="test_skip"><skipped/></testcase>
    </testsuite></testsuites>"""
    passed, failed, skipped = parse_junit(xml)
    assert passed == {"t.test_a::test_ok"}
    assert failed == {"t.test_a::test_bad", "t.test_a::test_err"}
    assert skipped == 1


def test_shipped_tasks_are_consistent_with_their_projects() -> None:
    tasks = load_records(SweRepair.default_tasks())
    assert {t["project"] for t in tasks} == set(PROJECTS)
    for t in tasks:
        project = PROJECTS[t["project"]]
        assert t["file"] in project.sources
        assert 1 <= len(t["fail_to_pass"]) <= 30
        assert t["before"] != t["after"]
        assert t["pristine_passed"] > len(t["fail_to_pass"])


def test_prompt_names_the_failing_tests_and_how_to_run_them() -> None:
    env = SweRepair()
    task = load_records(env.default_tasks())[0]
    text = env.prompt(task)[-1]["content"]
    assert task["fail_to_pass"][0] in text
    assert "python3 -m pytest" in text and f"/work/{task['project']}" in text


HOSTILE = [
    ({"file": "/etc/passwd"}, "task['file'] = '/etc/passwd' is not a library file"),
    ({"file": "../../../../etc/hostname"}, "is not a library file of toolz"),
    ({"file": "toolz/../../../x.py"}, "is not a library file"),
    ({"file": "toolz/tests/test_functoolz.py"}, "is not a library file"),  # a test file
    ({"file": ["toolz/itertoolz.py"]}, "is not a library file"),
    ({"project": "../toolz"}, "task['project'] = '../toolz' is not one of toolz"),
    ({"project": None}, "is not one of"),
    ({"line": "5"}, "task['line'] = '5' must be a line number"),
    ({"line": True}, "must be a line number"),
    ({"line": 0}, "must be a line number"),
    ({"before": "a\nb"}, "task['before'] must be one line"),
    ({"after": "x" * 5000}, "task['after'] must be one line"),
    ({"fail_to_pass": "t::x"}, "task['fail_to_pass'] must be a list"),
    ({"fail_to_pass": []}, "task['fail_to_pass'] must be a list"),
    ({"pristine_passed": -1}, "task['pristine_passed'] must be an integer"),
]


@pytest.mark.parametrize(("change", "why"), HOSTILE)
def test_task_fields_never_name_anything_but_listed_sources(change: dict, why: str) -> None:
    """A client's task is untrusted: `prompt` (what a submit runs) refuses it with the
    field and the fix, before anything reads a file."""
    env = SweRepair()
    task = {**load_records(env.default_tasks())[0], **change}
    with pytest.raises(EnvError, match=re.escape(why)):
        env.prompt(task)


async def test_setup_refuses_a_bad_task_before_touching_anything() -> None:
    env = SweRepair(backend="no-such-backend")  # nothing may be opened for a bad task
    task = {**load_records(env.default_tasks())[0], "file": "/etc/passwd"}
    ctx = libra.Context(episode_id="e", task=task, env=env)
    with pytest.raises(EnvError, match="is not a library file"):
        await env.setup(ctx)
    assert ctx.sandbox is None and env._backend is None


def test_every_shipped_task_passes_the_check() -> None:
    for task in load_records(SweRepair.default_tasks()):
        check_task(task)


def test_a_line_past_the_end_is_a_clear_error() -> None:
    with pytest.raises(EnvError, match="m.py has 6 lines, not a line 99"):
        Mutation("m.py", 99, "x", "y", "").apply(SOURCE)
