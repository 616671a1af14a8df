"""`arith`: arithmetic word problems with a calculator tool.

The smallest built-in tool environment: the model may call `calculator` on an
expression and must end with `<answer>N</answer>`. Tasks are generated from a seed
(`make_tasks`), so any number of them exist offline; `data/arith.jsonl` ships 64.
"""

from __future__ import annotations

import ast
import operator
import random
import warnings
from typing import Any

import libra
import libra.errors

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
}


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))  # type: ignore[no-any-return]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))  # type: ignore[no-any-return]
    raise ValueError("only integers and + - * // % are allowed")


@libra.tool(timeout=5)
def calculator(expression: str) -> str:
    """Evaluate an integer arithmetic expression.

    Args:
        expression: integers with + - * // % and parentheses, e.g. "(3 + 4) * 12".
    """
    if len(expression) > 200:
        raise libra.errors.ToolError("expression longer than 200 characters")
    try:
        with warnings.catch_warnings():
            # "1or 2" and the like parse with a warning on stderr (invalid decimal
            # literal): an error here.
            warnings.simplefilter("error")
            tree = ast.parse(expression, mode="eval")
        return str(_eval(tree))
    except (SyntaxError, Warning, ValueError, ZeroDivisionError) as e:
        raise libra.errors.ToolError(f"cannot evaluate {expression!r}: {e}") from None


def make_tasks(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` problems `a op b op c` with their answers, deterministic for a seed."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
        op1, op2 = rng.choice("+-*"), rng.choice("+-*")
        expr = f"({a} {op1} {b}) {op2} {c}"
        tasks.append(
            {
                "id": f"arith-{seed}-{i}",
                "question": f"What is {expr}?",
                "answer": str(_eval(ast.parse(expr, mode="eval"))),
            }
        )
    return tasks


class Arith(libra.Env):
    """Arithmetic with a calculator tool; reward 1 for the exact integer answer."""

    tools = [calculator]
    max_turns = 4
    tasks_file = "data/arith.jsonl"
    task_fields = ("question", "answer")

    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            {
                "role": "system",
                "content": "You can call the calculator tool. "
                "Give the final result as <answer>N</answer>.",
            },
            {"role": "user", "content": task["question"]},
        ]

    async def reward(self, task: dict[str, Any], trajectory: libra.Trajectory) -> float:
        return float(trajectory.answer is not None and trajectory.answer.strip() == task["answer"])
