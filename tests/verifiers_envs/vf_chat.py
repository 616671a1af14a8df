"""A single-turn verifiers 0.4 environment (`verifiers.v1`): one question, no tools, a
reward and a metric over the reply."""

from __future__ import annotations

import verifiers.v1 as vf


class ChatData(vf.TaskData):
    answer: str


class ChatTask(vf.Task[ChatData]):
    @vf.reward
    async def correct(self, task: ChatData, trace: vf.Trace) -> float:
        said = [str(m.content) for b in trace.branches for m in b.messages if m.role == "assistant"]
        return float(any(f"<answer>{task.answer}</answer>" in s for s in said))

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        msgs = trace.branches[-1].messages
        return float(sum(len(str(m.content)) for m in msgs if m.role == "assistant"))


class ChatTaskset(vf.Taskset[ChatTask]):
    def load(self):
        # DIRECTIVE:direct makes the test's scripted engine answer <answer>42</answer>.
        for i, (q, a) in enumerate([("6 * 7", "42"), ("5 * 5", "25")]):
            data = ChatData(id=f"chat-{i}", prompt=f"DIRECTIVE:direct What is {q}?", answer=a)
            yield ChatTask(data, self.config.task)


__all__ = ["ChatTaskset"]
