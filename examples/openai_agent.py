"""A small search agent written against the `openai` SDK, run and trained by Libra.

The agent talks to the model only through `openai.AsyncOpenAI`: it asks, runs the
`search` calls the model makes against Libra's built-in BM25 corpus (the one the
`search-qa` env ships), sends the results back as tool messages, and scores the final
`<answer>` against the gold answers:

    libra rollout --env examples/openai_agent.py:run --endpoint tp1=http://127.0.0.1:8000

Libra hands each episode a client pointing at its proxy and records every turn's token
ids, log-probs and loss mask as for a native env; the dict returned here is the reward
(`reward`), the answer (`answer`) and extra info. Prompt, tool and stop string are the
`search-qa` env's, so this agent and `--env search-qa` produce the same records. The
same function runs against any OpenAI-compatible server on its own:

    python examples/openai_agent.py --base-url http://127.0.0.1:8000/v1 --model NAME
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import threading
from typing import Any

import openai
from libra.envs.loading import load_records
from libra.envs.search_qa import HERE, SYSTEM, exact_match, f1, gold_answers
from libra.tools.search import MAX_K, Corpus, format_results
from libra.tools.search import search as search_tool

TOOLS = [search_tool.schema]  # {"type": "function", "function": {"name": "search", ...}}
_lock = threading.Lock()


@functools.cache
def _corpus() -> Corpus:
    return Corpus(load_records(HERE / "data" / "search_qa_corpus.jsonl"))


def search(query: str, k: int = 3) -> str:
    """The built-in corpus's best `k` passages (indexed on first use, once per process)."""
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k must be between 1 and {MAX_K}, got {k}")
    with _lock:
        corpus = _corpus()
    return format_results(corpus.search(query, k)) or "No results."


async def run(
    task: dict[str, Any], client: openai.AsyncOpenAI, model: str = "policy", max_turns: int = 6
) -> dict[str, Any]:
    """One episode: the model searches as often as it likes, then answers."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Question: {task['question']}"},
    ]
    searches, text = 0, ""
    for _ in range(max_turns):
        reply = await client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, stop=["</answer>"]
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        text = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            searches += 1
            try:
                if call.function.name != "search":
                    raise ValueError(f"unknown tool {call.function.name!r}")
                args = json.loads(call.function.arguments)
                result = await asyncio.to_thread(search, str(args["query"]), int(args.get("k", 3)))
            except Exception as e:  # the model's mistake goes back to it as an error
                result = f"Error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    # The stop string ends the turn and, as in OpenAI's API, is not part of the content.
    found = re.findall(r"<answer>(.*?)(?:</answer>|$)", text, re.DOTALL)
    if not found:
        return {"reward": 0.0, "answer": None, "searches": searches}
    answer, golds = found[-1].strip(), gold_answers(task)
    em = exact_match(answer, golds)
    return {"reward": em, "answer": answer, "f1": f1(answer, golds), "searches": searches}


run.tasks_file = str(HERE / "data" / "search_qa.jsonl")  # type: ignore[attr-defined]


def main() -> None:
    """Run the agent on a few tasks against any OpenAI-compatible server (no Libra)."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--model", required=True, help="served model name")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--num-tasks", type=int, default=8)
    args = ap.parse_args()
    tasks = load_records(run.tasks_file)[: args.num_tasks]  # type: ignore[attr-defined]

    async def all_tasks() -> None:
        client = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key)
        for task in tasks:
            out = await run(task, client, model=args.model)
            print(json.dumps({"question": task["question"], **out}))

    asyncio.run(all_tasks())


if __name__ == "__main__":
    main()
