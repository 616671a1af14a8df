"""The embedded engine's scheduler: continuous batching on one worker thread.

The aiohttp side submits requests and aborts through a thread-safe queue; the worker
thread owns the model, the KV cache and every running sequence, so nothing is shared
but the queue. Each loop iteration admits waiting requests (one prefill each, the n
choices of a prompt share it) while the batch and the KV budget allow, then runs one
batched decode step for all running sequences. A finished request's choices go back
through its `on_done` callback (called on the worker thread; the server hops them onto
the event loop).

Weight swaps (`swap_weights`) keep vLLM's `pause(mode="wait")` semantics: requests
the engine accepted before the swap (running, or still queued) finish on the old
weights, later ones wait, the weights change while the batch is empty (the KV cache is
dropped), then the waiting requests start on the new weights. So every response comes
from exactly one checkpoint, the one loaded when it was submitted: a client that stamps
a request with the version it sent it to is right.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tokenizers import Tokenizer

from libra.engine.detok import Detokenizer, final_text, find_stop
from libra.engine.model import Decoder, KVCache
from libra.engine.sampling import Sampler, SamplingParams, make_generator

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Choice:
    """One finished choice, before it is shaped into a response body."""

    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: int | str | None
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


@dataclass(eq=False, slots=True)
class Request:
    """One prompt and its n choices (each with its own sampling params)."""

    id: str
    prompt: list[int]
    params: list[SamplingParams]
    on_done: Callable[[list[Choice] | BaseException], None]
    choices: list[Choice | None] = field(default_factory=list)
    aborted: bool = False


@dataclass(eq=False, slots=True)
class _Seq:
    req: Request
    index: int
    params: SamplingParams
    generator: torch.Generator | None
    length: int  # tokens in the KV cache
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    detok: Detokenizer | None = None


class EngineCore:
    """Owns the worker thread. `submit`, `abort` and `swap_weights` are thread-safe."""

    def __init__(
        self,
        decoder: Decoder,
        tokenizer: Tokenizer,
        eos_ids: frozenset[int],
        *,
        max_num_seqs: int = 64,
        kv_cache_bytes: int = 2 << 30,
        threads: int = 1,
        seed: int | None = None,
    ):
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_num_seqs = max_num_seqs
        self.kv_cache_bytes = kv_cache_bytes
        self.threads = threads
        self.context = decoder.cfg.max_position_embeddings
        self.cache = KVCache(decoder.cfg)
        self.sampler = Sampler(seed)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._waiting: deque[Request] = deque()
        self._running: list[_Seq] = []
        self._swaps: list[tuple[dict[str, torch.Tensor], Callable[[], None]]] = []
        self._before_swap = 0
        """Queued requests (the first ones of `_waiting`) submitted before the pending
        swap: they still run on the old weights."""
        self._thread = threading.Thread(target=self._loop, name="libra-engine", daemon=True)

    # --- thread-safe API -------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(("stop", None))
        self._thread.join(timeout=30)

    def submit(self, req: Request) -> None:
        self._inbox.put(("add", req))

    def abort(self, req: Request) -> None:
        self._inbox.put(("abort", req))

    def swap_weights(self, weights: dict[str, torch.Tensor], done: Callable[[], None]) -> None:
        self._inbox.put(("swap", (weights, done)))

    @property
    def load(self) -> tuple[int, int]:
        """(running sequences, waiting requests), approximate (read across threads)."""
        return len(self._running), len(self._waiting)

    # --- worker thread ---------------------------------------------------------
    def _loop(self) -> None:
        torch.set_num_threads(self.threads)
        while True:
            busy = bool(self._running or self._waiting or self._swaps)
            if not self._drain(block=not busy):
                return
            try:
                if self._swaps and not self._running and not self._before_swap:
                    self._swap()
                if not self._swaps or self._before_swap:
                    self._admit()
                if self._running:
                    self._step()
            except Exception as e:  # a bug must not kill the server: fail the batch
                log.exception("engine step failed")
                self._fail_all(e)

    def _drain(self, block: bool) -> bool:
        while True:
            try:
                kind, item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                self._fail_all(RuntimeError("engine stopped"))
                return False
            if kind == "add":
                self._waiting.append(item)
            elif kind == "abort":
                item.aborted = True
                if item in self._waiting:
                    if self._waiting.index(item) < self._before_swap:
                        self._before_swap -= 1
                    self._waiting.remove(item)
                for s in [s for s in self._running if s.req is item]:
                    self._remove(s)
            elif kind == "swap":
                if not self._swaps:  # what is queued now was submitted before it
                    self._before_swap = len(self._waiting)
                self._swaps.append(item)

    def _swap(self) -> None:
        for weights, done in self._swaps:
            self.decoder.weights = weights
            done()
        self._swaps.clear()
        self.cache.clear()

    def _admit(self) -> None:
        """Start queued requests while they fit; with a swap pending, only those
        submitted before it."""
        while self._waiting and (not self._swaps or self._before_swap):
            req = self._waiting[0]
            n = len(req.params)
            rows = len(self._running) + n
            if self._running and rows > self.max_num_seqs:
                return
            longest = max(
                [s.length + s.params.max_tokens - len(s.tokens) for s in self._running]
                + [len(req.prompt) + p.max_tokens for p in req.params]
            )
            need = self.cache.bytes_for(rows, min(longest, self.context))
            if self._running and need > self.kv_cache_bytes:
                return
            self._waiting.popleft()
            if self._before_swap:
                self._before_swap -= 1
            try:
                self._prefill(req)
            except BaseException as e:
                # out of both lists now, `_fail_all` would not answer it: its client
                # waited for ever (a prefill that ran out of memory)
                self._running = [s for s in self._running if s.req is not req]  # answered once
                if not req.aborted:
                    req.on_done(e)
                raise

    def _prefill(self, req: Request) -> None:
        req.choices = [None] * len(req.params)
        first = len(self._running)
        self.cache.ensure(first + len(req.params), len(req.prompt) + 1)
        logits = self.decoder.prefill(req.prompt, self.cache, first)
        seqs = []
        for j, p in enumerate(req.params):
            if j:
                self.cache.move_row(first, first + j, len(req.prompt))
            detok = Detokenizer(self.tokenizer, p.skip_special_tokens) if p.stop else None
            seqs.append(_Seq(req, j, p, make_generator(p.seed), len(req.prompt), detok=detok))
        self._running.extend(seqs)
        self._emit(seqs, logits.unsqueeze(0).expand(len(seqs), -1))

    def _step(self) -> None:
        lengths = [s.length for s in self._running]
        self.cache.ensure(len(self._running), max(lengths) + 1)
        logits = self.decoder.decode([s.tokens[-1] for s in self._running], lengths, self.cache)
        for s in self._running:
            s.length += 1
        self._emit(list(self._running), logits)

    def _emit(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        params = [s.params for s in seqs]
        tokens, logprobs = self.sampler.sample(logits, params, [s.generator for s in seqs])
        for b, (s, tok) in enumerate(zip(seqs, tokens, strict=True)):
            s.tokens.append(tok)
            if s.params.logprobs is not None:
                s.logprobs.append(_reportable(float(logprobs[b, tok])))
                k = s.params.logprobs
                if k:
                    vals, idx = logprobs[b].topk(k)
                    s.tops.append(
                        [
                            (i, _reportable(v))
                            for i, v in zip(idx.tolist(), vals.tolist(), strict=True)
                        ]
                    )
                else:
                    s.tops.append([])
            done = self._finished(s, tok)
            if done is not None:
                self._finish(s, *done)

    def _finished(self, s: _Seq, tok: int) -> tuple[str, int | str | None] | None:
        p = s.params
        if tok in p.stop_token_ids:
            return "stop", tok
        if not p.ignore_eos and tok in self.eos_ids:
            return "stop", None
        if s.detok is not None:
            delta = s.detok.push(tok)
            hit = find_stop(s.detok.text, delta, p.stop) if delta else None
            if hit is not None:
                return "stop", hit[0]
        if len(s.tokens) >= p.max_tokens or s.length + 1 >= self.context:
            return "length", None
        return None

    def _finish(self, s: _Seq, finish_reason: str, stop_reason: int | str | None) -> None:
        text = final_text(
            self.tokenizer, s.tokens, s.params, stop_reason, finish_reason, self.eos_ids, s.detok
        )
        lp = s.params.logprobs is not None
        s.req.choices[s.index] = Choice(
            s.tokens,
            text,
            finish_reason,
            stop_reason,
            s.logprobs if lp else None,
            s.tops if lp else None,
        )
        self._remove(s)
        if all(c is not None for c in s.req.choices) and not s.req.aborted:
            s.req.on_done([c for c in s.req.choices if c is not None])

    def _remove(self, s: _Seq) -> None:
        """Drop a sequence; the last row moves into its place so rows stay packed."""
        row = self._running.index(s)
        last = self._running.pop()
        if last is not s:
            self.cache.move_row(len(self._running), row, last.length)
            self._running[row] = last

    def _fail_all(self, err: BaseException) -> None:
        reqs = {s.req for s in self._running} | set(self._waiting)
        self._running.clear()
        self._waiting.clear()
        self._before_swap = 0
        self.cache.clear()
        for req in reqs:
            if not req.aborted:
                req.on_done(err)


LOGPROB_FLOOR = -9999.0
"""The least log-prob a response carries: -inf (a token the model rules out) as vLLM's
server writes it, and NaN (a model whose weights overflowed) too, so a response is
always JSON."""


def _reportable(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN compares False


__all__ = ["LOGPROB_FLOOR", "Choice", "EngineCore", "Request"]
