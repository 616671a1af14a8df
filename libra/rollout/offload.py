"""Tokenizer work off the event loop.

Rendering and tokenizing are proportional to the text: about 1.5 s per MB on the
reference machine, so a 1 MB tool return tokenized on the loop stalls every episode,
stream and `/healthz` for that long. Work on texts up to `INLINE_CHARS` characters runs
inline (a thread hop would cost more than it saves); bigger work runs on one of
`THREADS` worker threads, each with its own `ChatTokenizer.clone()` (a fast tokenizer
shared across threads can fail with "Already borrowed", and the template's plan cache
is not locked). `ChatTokenizer.encode` releases the GIL on long texts (`Tokenizer.encode`
does not), so the loop keeps running meanwhile; the template's rendering still holds it
(~20 ms for 10 MB).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import orjson

from libra.chat import ChatTokenizer
from libra.usercode import start_threads

T = TypeVar("T")
INLINE_CHARS = 8192
"""Texts up to this size are tokenized inline (about 10 ms at worst)."""
THREADS = 2

_offloads: weakref.WeakKeyDictionary[ChatTokenizer, Offload] = weakref.WeakKeyDictionary()


class Offload:
    """Worker threads for one tokenizer; `await run(size, fn)` calls `fn(tokenizer)`."""

    def __init__(self, tok: ChatTokenizer, threads: int = THREADS):
        self.tok = tok
        self.threads = threads
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="libra-tokenize")
        self._warm_lock = threading.Lock()
        self._warmed = False

    def _own(self) -> ChatTokenizer:
        """This worker thread's own tokenizer (made on its first job)."""
        mine: ChatTokenizer | None = getattr(self._local, "tok", None)
        if mine is None:
            mine = self._local.tok = self.tok.clone()
        return mine

    def _job(self, fn: Callable[[ChatTokenizer], T]) -> T:
        return fn(self._own())

    async def run(self, size: int, fn: Callable[[ChatTokenizer], T]) -> T:
        """`fn(tokenizer)`: inline when `size` (characters of text involved) is small,
        else on a worker thread with that thread's tokenizer."""
        if size <= INLINE_CHARS:
            return fn(self.tok)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._job, fn)

    def warm(self) -> None:
        """Start the worker threads and give each its tokenizer now, once (blocking: off
        the loop, when a runner starts), so that the first big text pays for neither
        (`libra.usercode.start_threads` says why a start on the loop costs)."""
        with self._warm_lock:
            if not self._warmed:
                start_threads(self._pool, self.threads, then=self._own)
                self._warmed = True


def offload(tok: ChatTokenizer) -> Offload:
    """The shared `Offload` of a tokenizer (one set of threads per tokenizer object)."""
    found = _offloads.get(tok)
    if found is None:
        found = _offloads[tok] = Offload(tok)
    return found


def text_size(messages: Any) -> int:
    """Characters of text in chat messages: content strings, text parts and tool-call
    arguments (what a chat template renders, less its own markup)."""
    n = 0
    for m in messages or ():
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, str):
            n += len(content)
        elif isinstance(content, list):
            n += sum(len(str(p.get("text") or "")) for p in content if isinstance(p, dict))
        for call in m.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, dict) else None
            args = fn.get("arguments") if isinstance(fn, dict) else None
            n += len(args) if isinstance(args, str) else len(orjson.dumps(args, default=str))
    return n


__all__ = ["INLINE_CHARS", "Offload", "offload", "text_size"]
