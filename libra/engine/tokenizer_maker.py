"""Train the tiny model's byte-level BPE tokenizer (Qwen2-style) offline.

The pipeline copies Qwen2's: NFC normalisation, Qwen2's split regex (digits one by one),
byte-level alphabet, byte-level decoding. Ordinary tokens take ids `0..n-1`; the added
tokens follow in a fixed order, like Qwen2.5's: `<|endoftext|>`, `<|im_start|>`,
`<|im_end|>` are special (dropped by `skip_special_tokens`), the tool / answer / think
tags are added but NOT special, so they are one id each and stay in decoded text.
"""

from __future__ import annotations

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from libra.engine.corpus import corpus

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TAG_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<answer>",
    "</answer>",
    "<think>",
    "</think>",
)
# Qwen2's pre-tokenizer split (tokenizer.json of Qwen2.5): contractions, words with one
# leading non-letter, single digits, punctuation runs, newlines, spaces.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE with exactly `vocab_size` ids (ordinary + added), deterministic."""
    n_added = len(SPECIAL_TOKENS) + len(TAG_TOKENS)
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_added,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # The tags must not be learned as merges of ordinary text: strip them from the
    # corpus before training (they become added tokens below).
    docs = (_strip_tags(doc) for doc in corpus())
    tok.train_from_iterator(docs, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return tok


def _strip_tags(text: str) -> str:
    for t in (*SPECIAL_TOKENS, *TAG_TOKENS):
        text = text.replace(t, "\n")
    return text


__all__ = ["SPECIAL_TOKENS", "TAG_TOKENS", "train_tokenizer"]
