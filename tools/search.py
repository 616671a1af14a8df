"""`search`: BM25 retrieval over a local passage corpus (Search-R1 style).

`Corpus` holds passages (`id`, `title`, `text`) and a bm25s index (English stop words,
Snowball stemming via PyStemmer). The tool finds the corpus on the env
(`ctx.env.corpus`), so one tool serves every env that has a corpus. Results come back
in Search-R1's format, `Doc i(Title: ...) text`; `info` reports the payload size (the
tool-return size class C-MLFQ keys on is measured in tokens by the engine).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import libra
from libra.errors import ToolError

MAX_K = 10


class Corpus:
    """Passages and their BM25 index. Build once per run; `search` is thread-safe."""

    def __init__(self, passages: Iterable[Mapping[str, Any]]):
        import bm25s
        import Stemmer

        self.passages = [_passage(p, i) for i, p in enumerate(passages)]
        if not self.passages:
            raise ValueError("Corpus: no passages")
        self._stemmer = Stemmer.Stemmer("english")
        tokens = bm25s.tokenize(
            [f"{p['title']} {p['text']}" for p in self.passages],
            stopwords="en",
            stemmer=self._stemmer,
            show_progress=False,
        )
        self._index = bm25s.BM25()
        self._index.index(tokens, show_progress=False)

    def __len__(self) -> int:
        return len(self.passages)

    def search(self, query: str, k: int = 3) -> list[tuple[dict[str, str], float]]:
        """The `k` best passages for `query` with their scores, best first."""
        import bm25s

        k = min(k, len(self.passages))
        tokens = bm25s.tokenize([query], stopwords="en", stemmer=self._stemmer, show_progress=False)
        if not tokens.ids or not tokens.ids[0]:
            return []
        docs, scores = self._index.retrieve(tokens, k=k, show_progress=False)
        return [
            (self.passages[int(d)], float(s))
            for d, s in zip(docs[0], scores[0], strict=True)
            if s > 0
        ]


def _passage(p: Mapping[str, Any], i: int) -> dict[str, str]:
    """Accepts `{id, title, text}` or Search-R1's wiki dump rows `{id, contents}` where
    contents is `"Title"\\ntext`."""
    if "contents" in p and "text" not in p:
        title, _, text = str(p["contents"]).partition("\n")
        return {"id": str(p.get("id", i)), "title": title.strip('"'), "text": text}
    return {"id": str(p.get("id", i)), "title": str(p.get("title", "")), "text": str(p["text"])}


def format_results(hits: list[tuple[dict[str, str], float]]) -> str:
    return "\n".join(
        f"Doc {i}(Title: {p['title']}) {p['text']}" for i, (p, _) in enumerate(hits, 1)
    )


@libra.tool(timeout=30)
def search(query: str, ctx: libra.Context, k: int = 3) -> libra.ToolResult:
    """Search the knowledge corpus and return the most relevant passages.

    Args:
        query: keywords or a question.
        k: how many passages to return (1-10).
    """
    corpus = getattr(getattr(ctx, "env", None), "corpus", None)
    if not isinstance(corpus, Corpus):
        raise ToolError("search needs an env with a corpus (env.corpus)")
    if not 1 <= k <= MAX_K:
        raise ToolError(f"k must be between 1 and {MAX_K}, got {k}")
    if not query.strip():
        raise ToolError("empty query")
    hits = corpus.search(query, k)
    content = format_results(hits) or "No results."
    info = {"passages": len(hits), "payload_chars": len(content), "ids": [p["id"] for p, _ in hits]}
    return libra.ToolResult(content, "ok", info)


__all__ = ["MAX_K", "Corpus", "format_results", "search"]
