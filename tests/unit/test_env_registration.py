"""A bad env is one error when it loads, naming the attribute: each was an error in every
episode (`'function' object has no attribute 'name'`), tools silently lost or shadowed,
or a traceback when the runner started (`stop = None`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import libra
from libra.errors import ConfigError, LibraError
from libra.registry import load_object
from libra.rollout.run import load_env


@libra.tool
def echo(text: str) -> str:
    """Echo.

    Args:
        text: what to echo.
    """
    return text


def plain(text: str) -> str:
    return text


class Base(libra.Env):
    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "hi"}]


BAD: list[tuple[dict[str, Any], str]] = [
    ({"tools": [plain]}, "tools holds a function, not a tool"),
    ({"tools": "echo"}, "tools is a str"),
    ({"tools": (t for t in [echo])}, "tools is a generator"),
    ({"tools": [echo, libra.tool(name="echo")(plain)]}, "two tools are named 'echo'"),
    ({"max_turns": 0}, "max_turns is 0"),
    ({"max_turns": "3"}, "max_turns is '3'"),
    ({"stop": None}, "stop is None"),
    ({"stop": "</answer>"}, "stop is '</answer>'"),
]


@pytest.mark.parametrize(("attrs", "says"), BAD, ids=[s for _, s in BAD])
def test_a_bad_env_class_is_refused_when_it_loads(attrs: dict[str, Any], says: str) -> None:
    env = type("Bad", (Base,), attrs)
    libra.registry.envs.register("test-bad-env", env)
    with pytest.raises(ConfigError, match=f"env 'test-bad-env': {says}"):
        load_env("test-bad-env", {})


def test_a_good_one_loads() -> None:
    libra.registry.envs.register("test-good-env", type("Good", (Base,), {"tools": [echo]}))
    assert load_env("test-good-env", {}).tools == [echo]


def test_an_env_file_that_exits_as_it_is_imported(tmp_path: Path) -> None:
    """`sys.exit(0)` at import made `libra rollout` exit 0 with no output at all."""
    (tmp_path / "quits.py").write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(LibraError, match="failed: SystemExit: 0"):
        load_object(f"{tmp_path}/quits.py:Env", "env")
