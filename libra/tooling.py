"""`libra.tool`: an (async or sync) function becomes a tool the model may call.

The JSON schema comes from the type hints and the docstring: the first paragraph is the
description, an `Args:` section (Google style) documents the parameters. A parameter
annotated `libra.Context` receives the episode's context (its sandbox, task and scratch
state) and is left out of the schema.

A tool reports failure by raising or by returning `ToolResult(content, status="error")`;
whatever else goes wrong in it (a return value that is not text, a `ToolResult` with
bad fields, a value JSON cannot hold) is the tool's error too: the call returns an
`error` result and the episode goes on.

It runs under its own timeout (`@libra.tool(timeout=...)`) through `libra.usercode`: an
async tool in a task of its own, so the limit holds even for one that swallows
cancellation (`timeout`); a sync tool in a thread of the user-code pool, never on the
event loop. Python cannot kill a thread: on timeout the episode moves on and the thread
finishes in the background, so sync tools that may hang should run their work where it
can be killed (a sandbox, a subprocess).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_type_hints, overload

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from libra import usercode
from libra.errors import ToolError

DEFAULT_TOOL_TIMEOUT_S = 60.0


@dataclass(slots=True)
class ToolResult:
    """What a tool returns to the model."""

    content: str
    """Text appended to the conversation as the tool message."""
    status: Literal["ok", "error", "timeout"] = "ok"
    """`error` marks a failed call (C-MLFQ keys on it); `timeout` is set by Libra."""
    info: dict[str, Any] | None = None
    """Extra data for the env (not shown to the model), e.g. exit code, payload sizes."""


@dataclass(slots=True)
class Context:
    """Per-episode context handed to tools that ask for it and to env hooks."""

    episode_id: str
    task: dict[str, Any]
    env: Any = None
    """The Env instance running the episode."""
    sandbox: Any = None
    """The episode's sandbox, when the env created one in `setup`."""
    state: dict[str, Any] = field(default_factory=dict)
    """Scratch space shared by the env's hooks and tools during one episode."""


class Tool:
    """A callable tool with an OpenAI function schema."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout: float = DEFAULT_TOOL_TIMEOUT_S,
    ):
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not (0 < timeout < math.inf)
        ):  # NaN passed `<= 0` and made every call an instant `timeout`
            raise ValueError(f"tool timeout must be a finite number of seconds > 0, got "
                             f"{timeout!r}")  # fmt: skip
        self.fn = fn
        self.name = name or fn.__name__
        self.timeout = timeout
        self.is_async = inspect.iscoroutinefunction(fn)
        doc_desc, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
        self.description = description or doc_desc or self.name
        self._ctx_param: str | None = None
        self._args_model = self._build_args_model(arg_docs)
        schema = self._args_model.model_json_schema()
        schema.pop("title", None)
        for prop in schema.get("properties", {}).values():
            prop.pop("title", None)
        self.parameters: dict[str, Any] = schema

    def _build_args_model(self, arg_docs: dict[str, str]) -> type[BaseModel]:
        hints = get_type_hints(self.fn)
        fields: dict[str, Any] = {}
        for pname, param in inspect.signature(self.fn).parameters.items():
            ann = hints.get(pname, Any)
            if ann is Context:
                self._ctx_param = pname
                continue
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"tool {self.name!r}: *args/**kwargs are not allowed")
            if pname.startswith("_") or pname == "model_config":
                # pydantic keeps these names for itself: `model_config` left the schema
                # (the tool could never be called), `_x` was a PydanticUserError
                raise TypeError(f"tool {self.name!r}: a parameter cannot be named "
                                f"{pname!r} (a name pydantic reserves); rename it")  # fmt: skip
            from pydantic import Field

            default = ... if param.default is inspect.Parameter.empty else param.default
            fields[pname] = (ann, Field(default, description=arg_docs.get(pname)))
        model: type[BaseModel] = create_model(
            f"{self.name}_args", __config__=ConfigDict(extra="forbid"), **fields
        )
        return model

    @property
    def schema(self) -> dict[str, Any]:
        """OpenAI `tools=[...]` entry."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the underlying function directly (handy in tests)."""
        return self.fn(*args, **kwargs)

    async def invoke(
        self, arguments: dict[str, Any], ctx: Context | None = None, *, limit_s: float | None = None
    ) -> ToolResult:
        """Validate arguments, run under the tool's timeout (or `limit_s` when that is
        shorter), never raise (but cancellation)."""
        try:
            parsed = self._args_model.model_validate(arguments)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'arguments'}: {err['msg']}"
                for err in e.errors()
            )
            return ToolResult(f"Error: invalid arguments for {self.name}: {problems}", "error")
        kwargs = {k: getattr(parsed, k) for k in type(parsed).model_fields}
        if self._ctx_param is not None:
            kwargs[self._ctx_param] = ctx
        limit = self.timeout if limit_s is None else min(limit_s, self.timeout)
        try:
            fn = functools.partial(self.fn, **kwargs)
            out = await usercode.call(fn, limit_s=limit, what=f"tool {self.name}")
        except TimeoutError:
            return ToolResult(f"Error: {self.name} timed out after {limit:g} s", "timeout")
        except ToolError as e:
            return ToolResult(f"Error: {e}", "error")
        except Exception as e:
            return ToolResult(f"Error: {usercode.describe(e)}", "error")
        try:
            if isinstance(out, str | ToolResult) or out is None:
                return as_result(out)
            return await asyncio.to_thread(as_result, out)  # JSON as big as the value
        except ToolError as e:  # the tool's mistake, told to the model like any error
            return ToolResult(f"Error: {self.name} {e}", "error")

    def __repr__(self) -> str:
        return f"<libra.Tool {self.name}>"


def as_result(out: Any) -> ToolResult:
    """A tool's return value as a `ToolResult`: text as is, None as "", a `ToolResult`
    when its fields are right, anything else as JSON. Raises `ToolError` naming what is
    wrong (the caller makes it the call's `error`)."""
    if isinstance(out, ToolResult):
        if not isinstance(out.content, str):
            raise ToolError(
                f"returned a ToolResult whose content is a {type(out.content).__name__}; "
                "content must be a str"
            )
        if out.status not in ("ok", "error", "timeout"):
            raise ToolError(
                f"returned a ToolResult with status {out.status!r}; use 'ok', 'error' or 'timeout'"
            )
        if out.info is not None and not isinstance(out.info, dict):
            raise ToolError(
                f"returned a ToolResult whose info is a {type(out.info).__name__}; "
                "info must be a dict or None"
            )
        return out
    if out is None:
        return ToolResult("")
    if isinstance(out, str):
        return ToolResult(out)
    try:
        return ToolResult(orjson.dumps(out, option=orjson.OPT_NON_STR_KEYS).decode())
    except TypeError as e:
        raise ToolError(
            f"returned a {type(out).__name__} that is not JSON-serialisable ({e}); return "
            "a str, JSON data or a libra.ToolResult"
        ) from None


@overload
def tool(fn: Callable[..., Awaitable[Any]] | Callable[..., Any], /) -> Tool: ...
@overload
def tool(
    *, name: str | None = None, description: str | None = None, timeout: float = ...
) -> Callable[[Callable[..., Any]], Tool]: ...
def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float = DEFAULT_TOOL_TIMEOUT_S,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Decorator: `@libra.tool` or `@libra.tool(timeout=10, name="calc")`."""
    if fn is not None:
        return Tool(fn)

    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool(f, name=name, description=description, timeout=timeout)

    return wrap


_ARG_LINE = re.compile(r"^\s{0,8}(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """First paragraph -> description; `Args:` section -> {param: description}."""
    if not doc:
        return "", {}
    lines = doc.splitlines()
    desc_lines: list[str] = []
    for line in lines:
        if not line.strip() or line.strip().rstrip(":").lower() in ("args", "arguments"):
            break
        desc_lines.append(line.strip())
    args: dict[str, str] = {}
    in_args, current = False, None
    for line in lines:
        stripped = line.strip()
        if stripped.rstrip(":").lower() in (
            "args",
            "arguments",
            "parameters",
        ) and stripped.endswith(":"):
            in_args = True
            continue
        if in_args:
            if stripped.endswith(":") and not line.startswith((" ", "\t")):
                break  # next section (Returns:, Raises:)
            m = _ARG_LINE.match(line)
            if m and line.startswith((" ", "\t")) and len(line) - len(line.lstrip()) <= 8:
                current = m.group(1)
                args[current] = m.group(2).strip()
            elif current and stripped:
                args[current] += " " + stripped
    return " ".join(desc_lines), args


__all__ = ["DEFAULT_TOOL_TIMEOUT_S", "Context", "Tool", "ToolResult", "as_result", "tool"]
