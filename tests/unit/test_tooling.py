"""`libra.tool`: schema from hints + docstring, validation, timeouts, failures as data."""

from __future__ import annotations

import asyncio
import time

import pytest

import libra
from libra.errors import ToolError


@libra.tool
async def add(a: int, b: int = 2) -> str:
    """Add two integers.

    Args:
        a: the first addend.
        b: the second addend,
            defaulting to two.
    """
    return str(a + b)


@libra.tool(timeout=0.2, name="slow")
async def slow_tool(seconds: float) -> str:
    """Sleep."""
    await asyncio.sleep(seconds)
    return "done"


@libra.tool(timeout=0.3)
def blocking(seconds: float) -> dict:
    """A sync tool runs in a thread."""
    time.sleep(seconds)
    return {"slept": seconds}


@libra.tool
async def uses_context(key: str, ctx: libra.Context) -> str:
    """Read the episode's scratch state."""
    return str(ctx.state.get(key))


@libra.tool
async def fails(kind: str) -> libra.ToolResult:
    """Fail in different ways."""
    if kind == "raise":
        raise ToolError("it broke")
    if kind == "crash":
        raise ZeroDivisionError("division by zero")
    return libra.ToolResult("exit 1", status="error")


def test_schema_from_hints_and_docstring() -> None:
    fn = add.schema["function"]
    assert fn["name"] == "add"
    assert fn["description"] == "Add two integers."
    props = fn["parameters"]["properties"]
    assert props["a"] == {"type": "integer", "description": "the first addend."}
    assert props["b"]["default"] == 2
    assert props["b"]["description"] == "the second addend, defaulting to two."
    assert fn["parameters"]["required"] == ["a"]
    # the context parameter is injected, never shown to the model
    assert "ctx" not in uses_context.schema["function"]["parameters"]["properties"]
    assert slow_tool.name == "slow"


async def test_invoke_validates_and_coerces() -> None:
    assert (await add.invoke({"a": "3", "b": 4})).content == "7"
    bad = await add.invoke({"b": 1})
    assert bad.status == "error" and "a: Field required" in bad.content
    extra = await add.invoke({"a": 1, "c": 2})
    assert extra.status == "error" and "c" in extra.content


async def test_timeouts_and_failures_become_statuses() -> None:
    r = await slow_tool.invoke({"seconds": 5})
    assert r.status == "timeout" and "0.2 s" in r.content
    assert (await blocking.invoke({"seconds": 0.01})).content == '{"slept":0.01}'
    assert (await blocking.invoke({"seconds": 1.0})).status == "timeout"
    for kind, text in (("raise", "it broke"), ("crash", "ZeroDivisionError"), ("status", "exit 1")):
        r = await fails.invoke({"kind": kind})
        assert r.status == "error" and text in r.content


async def test_context_injection() -> None:
    ctx = libra.Context(episode_id="e", task={}, state={"k": "v"})
    assert (await uses_context.invoke({"key": "k"}, ctx)).content == "v"


def test_direct_call_still_works() -> None:
    assert asyncio.run(add(1, 2)) == "3"


def test_a_timeout_that_is_not_a_finite_positive_number_is_refused() -> None:
    """`timeout=float("nan")` passed the `<= 0` check, and every call of the tool was an
    instant `timeout`."""

    def f(x: int) -> str:
        """F."""
        return str(x)

    for bad in (float("nan"), float("inf"), 0, -1, "5", True):
        with pytest.raises(ValueError, match="finite number of seconds > 0"):
            libra.tool(timeout=bad)(f)  # type: ignore[arg-type]
    assert libra.tool(timeout=2)(f).timeout == 2


def test_a_parameter_name_pydantic_keeps_is_refused_by_name() -> None:
    """A parameter named `model_config` dropped out of the schema: the tool could never
    be called; `_x` was a PydanticUserError from deep in pydantic."""

    def a(model_config: str) -> str:
        """A."""
        return model_config

    def b(_x: str) -> str:
        """B."""
        return _x

    def c(schema: str, json: int) -> str:  # names pydantic only warns about: they work
        """C."""
        return schema * json

    for fn, name in ((a, "model_config"), (b, "_x")):
        with pytest.raises(TypeError, match=f"cannot be named '{name}'"):
            libra.tool(fn)
    tool_c = libra.tool(c)
    assert set(tool_c.schema["function"]["parameters"]["properties"]) == {"schema", "json"}
    assert asyncio.run(tool_c.invoke({"schema": "ab", "json": 2})).content == "abab"
