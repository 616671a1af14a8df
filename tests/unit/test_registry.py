from __future__ import annotations

import sys
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


def test_two_files_of_like_names_are_two_modules(tmp_path: Path) -> None:
    """A module was named by a file's last three path parts, `-` as `_`: the second of
    `/a/p/q/envs.py` and `/b/p/q/envs.py` (or `my-envs.py` and `my_envs.py`) silently
    ran as the first."""
    files = [tmp_path / "a/p/q/envs.py", tmp_path / "b/p/q/envs.py",
             tmp_path / "c/my-envs.py", tmp_path / "c/my_envs.py"]  # fmt: skip
    for i, f in enumerate(files):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(ENV_FILE.replace("class Echo", f"WHO = {i}\n\nclass Echo"))
    got = [registry.envs.get(f"{f}:Echo") for f in files]
    assert [sys.modules[c.__module__].WHO for c in got] == [0, 1, 2, 3]
    assert registry.envs.get(f"{files[1]}:Echo") is got[1]  # the same file: one module


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
