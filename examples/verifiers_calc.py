"""A multi-turn verifiers 0.4 tool environment, written against its public API
(`verifiers.v1`): arithmetic questions, an MCP `calculator` tool, a reward that checks the
`<answer>`, a metric counting tool turns. Run by Libra (from the repository root):

    PYTHONPATH=examples libra rollout --env verifiers:verifiers_calc \
        --endpoint tp1=http://127.0.0.1:8000

verifiers starts the tool server as `python -m verifiers_calc` (the block at the end).
"""

from __future__ import annotations

import ast
import operator

import verifiers.v1 as vf

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
QUESTIONS = [(2, 3), (7, 5), (12, 4)]


def evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](evaluate(node.left), evaluate(node.right))
    raise ValueError("only + - * on integers")


class Calculator(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the model calls `calculator`, not `calculator_calculator`

    @vf.tool
    async def calculator(self, expression: str) -> str:
        """Evaluate an integer expression with + - * and parentheses."""
        return str(evaluate(ast.parse(expression, mode="eval").body))


class CalcData(vf.TaskData):
    answer: str


class CalcTask(vf.Task[CalcData]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [Calculator(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, task: CalcData, trace: vf.Trace) -> float:
        said = [str(m.content) for b in trace.branches for m in b.messages if m.role == "assistant"]
        return float(any(f"<answer>{task.answer}</answer>" in s for s in said))

    @vf.metric
    async def tool_turns(self, trace: vf.Trace) -> float:
        return float(sum(m.role == "tool" for m in trace.branches[-1].messages))


class CalcTaskset(vf.Taskset[CalcTask]):
    def load(self):
        for i, (a, b) in enumerate(QUESTIONS):
            data = CalcData(id=f"calc-{i}", prompt=f"What is {a} * {b}?", answer=str(a * b))
            yield CalcTask(data, self.config.task)


__all__ = ["CalcTaskset"]

if __name__ == "__main__":
    Calculator.run()
