"""`search-qa`: Search-R1 style question answering with a BM25 `search` tool.

The model searches a passage corpus as often as it needs and ends with
`<answer>...</answer>`. Reward: exact match after SQuAD normalisation (lower case, no
punctuation, no articles) against any gold answer; `reward="f1"` gives token F1
instead. Both are reported in `reward_info`.

Data (docs/envs.md): the shipped corpus (1,178 passages on 237 countries) and 256
single-hop and two-hop questions are generated from the `countryinfo` package's data by
`data/make_search_qa.py`. A real Search-R1 setup loads its own files: `corpus=` a
wiki dump in Search-R1's `{id, contents}` JSONL (or `{id, title, text}`), `--tasks` a
question file with `question` and `answers` (or Search-R1's `golden_answers`).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from functools import cached_property
from pathlib import Path
from typing import Any

from libra.envs.loading import load_records
from libra.tools.search import Corpus, search

import libra

HERE = Path(__file__).parent
SYSTEM = (
    "Answer the question. You may call the search tool as many times as you need to "
    "look facts up in the knowledge corpus. When you know the answer, reply with it "
    "inside <answer> and </answer> and nothing else, for example <answer>Paris</answer>."
)


def normalize(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, golds: list[str]) -> float:
    p = normalize(prediction)
    return float(any(p == normalize(g) for g in golds))


def f1(prediction: str, golds: list[str]) -> float:
    best = 0.0
    pred = normalize(prediction).split()
    for g in golds:
        gold = normalize(g).split()
        common = sum((Counter(pred) & Counter(gold)).values())
        if common:
            precision, recall = common / len(pred), common / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def gold_answers(task: dict[str, Any]) -> list[str]:
    answers = task.get("answers", task.get("golden_answers", task.get("answer")))
    if isinstance(answers, str):
        return [answers]
    if isinstance(answers, dict):  # Search-R1 parquet rows: {"target": [...]}
        answers = answers.get("target", [])
    return [str(a) for a in answers or []]


class SearchQA(libra.Env):
    """Retrieval QA over a local corpus; options: `corpus` (path), `reward` (em | f1)."""

    tools = [search]
    max_turns = 6
    tasks_file = "data/search_qa.jsonl"
    task_fields = ("question", "answers")

    def __init__(self, corpus: str | None = None, reward: str = "em", **options: Any):
        super().__init__(corpus=corpus, reward=reward, **options)
        if reward not in ("em", "f1"):
            raise libra.LibraError(f"search-qa: reward must be 'em' or 'f1', got {reward!r}")
        self.corpus_path = Path(corpus) if corpus else HERE / "data" / "search_qa_corpus.jsonl"
        self.reward_kind = reward

    @cached_property
    def corpus(self) -> Corpus:
        """Loaded and indexed on first use (one index per run)."""
        return Corpus(load_records(self.corpus_path))

    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Question: {task['question']}"},
        ]

    async def reward(self, task: dict[str, Any], trajectory: libra.Trajectory) -> Any:
        golds = gold_answers(task)
        if trajectory.answer is None:
            return 0.0, {"em": 0.0, "f1": 0.0, "answered": False}
        em, f = exact_match(trajectory.answer, golds), f1(trajectory.answer, golds)
        return (em if self.reward_kind == "em" else f), {"em": em, "f1": f, "answered": True}


__all__ = ["SearchQA", "exact_match", "f1", "gold_answers", "normalize"]
