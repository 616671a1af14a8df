from __future__ import annotations

from pathlib import Path

import pytest

import libra
from libra import registry
from libra.errors import RegistryError

ENV_FILE = """
import libra

@libra.tool
async def echo(text: str) -> str:
    '''Echo.'''
    return text

class Echo(libra.Env):
    tools = [echo]
    def prompt(self, task):
        return [{"role": "user", "content": task["q"]}]
"""


def test_builtin_by_id_and_listing() -> None:
    cls = registry.envs.get("arith")
    assert issubclass(cls, libra.Env)
    entries = {e.id: e for e in registry.envs.entries()}
    assert entries["arith"].source == "builtin"
    assert entries["arith"].target == "libra.envs.arith:Arith"


def test_load_by_file_path_and_module_path(tmp_path: Path) -> None:
    f = tmp_path / "my_envs.py"
    f.write_text(ENV_FILE)
    cls = registry.envs.get(f"{f}:Echo")
    assert cls.__name__ == "Echo" and cls.tools[0].name == "echo"
    assert registry.envs.get("libra.envs.arith:Arith") is registry.envs.get("arith")


def test_unknown_id_lists_known_ones(tmp_path: Path) -> None:
    with pytest.raises(RegistryError, match=r"unknown env 'nope'; known: .*arith"):
        registry.envs.get("nope")
    with pytest.raises(RegistryError, match="not found"):
        registry.envs.get(f"{tmp_path}/missing.py:X")
    with pytest.raises(RegistryError, match="has no attribute"):
        registry.envs.get("libra.envs.arith:Missing")
    bad = tmp_path / "broken.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(RegistryError, match="boom"):
        registry.envs.get(f"{bad}:X")


def test_runtime_registration() -> None:
    reg = registry.Registry("thing", "libra.test-things", {})
    reg.register("mine", registry.load_object)
    assert reg.get("mine") is registry.load_object
    assert [e.source for e in reg.entries()] == ["runtime"]
