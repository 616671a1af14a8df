"""The BM25 `search` tool on the shipped search-qa corpus."""

from __future__ import annotations

from libra.envs.loading import load_records
from libra.envs.search_qa import SearchQA, gold_answers
from libra.tools.search import Corpus, search

import libra


def test_single_hop_questions_find_their_passage() -> None:
    env = SearchQA()
    tasks = [t for t in load_records(env.default_tasks()) if t["kind"] == "capital"]
    hits = 0
    for task in tasks:
        top = env.corpus.search(task["question"], k=3)
        hits += any(a in p["text"] for p, _ in top for a in gold_answers(task))
    assert hits / len(tasks) >= 0.9  # BM25 is strong on entity-name questions


async def test_search_tool_returns_passages_with_sizes() -> None:
    env = SearchQA()
    ctx = libra.Context("e", {}, env=env)
    result = await search.invoke({"query": "capital of Peru", "k": 2}, ctx)
    assert result.status == "ok"
    assert result.content.startswith("Doc 1(Title: Peru)") and "Lima" in result.content
    assert result.info == {
        "passages": 2,
        "payload_chars": len(result.content),
        "ids": result.info["ids"],
    }
    bad = await search.invoke({"query": "x", "k": 50}, ctx)
    assert bad.status == "error" and "between 1 and 10" in bad.content


def test_corpus_accepts_search_r1_rows() -> None:
    corpus = Corpus(
        [
            {"id": "1", "contents": '"Lima"\nLima is the capital of Peru.'},
            {"id": "2", "contents": '"Oslo"\nOslo is the capital of Norway.'},
        ]
    )
    (best, score), *_ = corpus.search("Norway capital", k=1)
    assert best["title"] == "Oslo" and score > 0
    assert corpus.search("zzzz qqqq", k=1) == []
