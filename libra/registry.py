"""One registry pattern for envs, tools and sandbox backends.

An id maps to a `"module:object"` target, imported on first use. Ids come from the
built-ins below and from the entry-point groups `libra.envs`, `libra.tools`,
`libra.sandboxes` of installed distributions. Anything can also be named by path:
`my_envs.py:Adder` (a file) or `package.module:Adder` (an importable module).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from libra.errors import RegistryError

# Built-ins: id -> "module:object". Add a line when a built-in lands.
BUILTIN_ENVS: dict[str, str] = {
    "arith": "libra.envs.arith:Arith",
    "math": "libra.envs.math:Math",
    "search-qa": "libra.envs.search_qa:SearchQA",
    "swe-repair": "libra.envs.swe_repair:SweRepair",
}
BUILTIN_TOOLS: dict[str, str] = {
    "bash": "libra.tools.shell:bash",
    "calculator": "libra.envs.arith:calculator",
    "edit": "libra.tools.files:edit",
    "python": "libra.tools.shell:python",
    "search": "libra.tools.search:search",
    "submit": "libra.tools.submit:submit",
    "view": "libra.tools.files:view",
}
BUILTIN_SANDBOXES: dict[str, str] = {
    "auto": "libra.sandboxes.auto:auto",
    "bwrap": "libra.sandboxes.bwrap:BwrapBackend",
    "docker": "libra.sandboxes.docker:DockerBackend",
}


@dataclass(frozen=True, slots=True)
class Entry:
    id: str
    target: str
    """`module:object` it resolves to."""
    source: str
    """`builtin` or `entry-point (<distribution>)`."""


class Registry:
    """id -> `module:object`; objects are imported on first `get` and cached."""

    def __init__(self, kind: str, group: str, builtins: dict[str, str]):
        self.kind = kind
        self.group = group
        self._builtins = builtins
        self._extra: dict[str, Entry] = {}
        self._cache: dict[str, Any] = {}

    def register(self, id: str, target: str | Any, source: str = "runtime") -> None:
        """Register an id at run time (a target string or the object itself)."""
        if isinstance(target, str):
            self._extra[id] = Entry(id, target, source)
            self._cache.pop(id, None)
        else:
            name = f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', '?')}"
            self._extra[id] = Entry(id, name, source)
            self._cache[id] = target

    def entries(self) -> list[Entry]:
        found: dict[str, Entry] = {k: Entry(k, v, "builtin") for k, v in self._builtins.items()}
        for ep in entry_points(group=self.group):
            dist = ep.dist.name if ep.dist is not None else "?"
            found.setdefault(ep.name, Entry(ep.name, ep.value, f"entry-point ({dist})"))
        found.update(self._extra)
        return sorted(found.values(), key=lambda e: e.id)

    def known(self) -> list[str]:
        return [e.id for e in self.entries()]

    def get(self, name: str) -> Any:
        """Resolve an id, `file.py:Obj` or `pkg.mod:Obj` to the object."""
        if name in self._cache:
            return self._cache[name]
        by_id = {e.id: e for e in self.entries()}
        if name in by_id:
            obj = load_object(by_id[name].target, what=f"{self.kind} {name!r}")
        elif ":" in name:
            obj = load_object(name, what=self.kind)
        else:
            known = ", ".join(by_id) or "(none)"
            raise RegistryError(
                f"unknown {self.kind} {name!r}; known: {known} "
                f"(or give a path: file.py:Name or package.module:Name)"
            )
        self._cache[name] = obj
        return obj


def load_object(spec: str, what: str = "object") -> Any:
    """Import `module:attr` or `path/to/file.py:attr` (attr may be dotted)."""
    mod_name, sep, attr = spec.rpartition(":")
    if not sep or not mod_name or not attr:
        raise RegistryError(f"{what}: {spec!r} is not of the form module:Name or file.py:Name")
    if mod_name.endswith(".py") or "/" in mod_name:
        path = Path(mod_name)
        if not path.is_file():
            raise RegistryError(f"{what}: file {mod_name!r} not found")
        module = _import_file(path)
    else:
        try:
            module = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            raise RegistryError(f"{what}: cannot import module {mod_name!r} ({e})") from None
        except (Exception, SystemExit) as e:  # its own code failed as it was imported
            raise RegistryError(f"{what}: importing module {mod_name!r} failed: "
                                f"{type(e).__name__}: {e}") from None  # fmt: skip
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise RegistryError(f"{what}: {mod_name!r} has no attribute {attr!r}") from None
    return obj


def _import_file(path: Path) -> Any:
    resolved = path.resolve()
    # Named by the whole path: by its last three parts, `/a/p/q/envs.py` and
    # `/b/p/q/envs.py` (or `my-envs.py` and `my_envs.py`) were one module, and the
    # second file silently ran as the first.
    digest = hashlib.sha1(str(resolved).encode(errors="surrogateescape")).hexdigest()[:12]
    stem = re.sub(r"\W", "_", resolved.stem)
    name = f"libra_user_{stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise RegistryError(f"cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # Let the file import its siblings.
    sys.path.insert(0, str(resolved.parent))
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # a file that calls sys.exit() as it is imported
        del sys.modules[name]
        raise RegistryError(f"importing {str(path)!r} failed: {type(e).__name__}: {e}") from None
    finally:
        sys.path.remove(str(resolved.parent))
    return module


envs = Registry("env", "libra.envs", BUILTIN_ENVS)
tools = Registry("tool", "libra.tools", BUILTIN_TOOLS)
sandboxes = Registry("sandbox backend", "libra.sandboxes", BUILTIN_SANDBOXES)

__all__ = ["Entry", "Registry", "envs", "load_object", "sandboxes", "tools"]
