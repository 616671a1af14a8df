"""ChatTokenizer renders like transformers and appends deltas that equal a full render."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra.chat import ChatTokenizer
from libra.errors import ModelError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
OPENING = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is (3 + 4) * 2?"},
]


def test_render_matches_transformers(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_model))
    ours = ChatTokenizer(tiny_model)
    for tools in (None, TOOLS):
        want = hf.apply_chat_template(
            OPENING, tools=tools, add_generation_prompt=True, tokenize=False
        )
        assert ours.render(OPENING, tools) == want
        assert ours.prompt_ids(OPENING, tools) == hf.encode(want, add_special_tokens=False)


@pytest.mark.parametrize("model_closed_turn", [True, False])
def test_incremental_tokens_equal_full_render(tiny_model: Path, model_closed_turn: bool) -> None:
    """prompt + model turn + delta decodes to the render of the whole conversation."""
    tok = ChatTokenizer(tiny_model)
    assistant = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "(3 + 4) * 2"}}</tool_call>'
    )
    tool_msgs = [
        {"role": "tool", "name": "calculator", "content": "14"},
        {"role": "tool", "name": "calculator", "content": "second"},
    ]
    model_ids = tok.encode(assistant) + ([tok.eos_token_ids[0]] if model_closed_turn else [])
    ids = (
        tok.prompt_ids(OPENING, TOOLS)
        + model_ids
        + tok.delta_ids(tool_msgs, TOOLS, model_closed_turn=model_closed_turn)
    )
    full = tok.render([*OPENING, {"role": "assistant", "content": assistant}, *tool_msgs], TOOLS)
    assert tok.decode(ids) == full
    # The delta holds exactly one end-of-turn token before the tool turn either way.
    assert tok.decode(ids).count("<|im_end|>") == full.count("<|im_end|>")


def test_special_tokens_are_single_ids(tiny_model: Path) -> None:
    tok = ChatTokenizer(tiny_model)
    for t in ("<|im_end|>", "<tool_call>", "</tool_call>", "</answer>"):
        assert tok.token_id(t) is not None
    assert tok.eos_token == "<|im_end|>"
    assert tok.token_id("<|im_end|>") in tok.eos_token_ids


def test_missing_pieces_are_clear_errors(tmp_path: Path, tiny_model: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        ChatTokenizer(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no tokenizer.json"):
        ChatTokenizer(tmp_path / "empty")
    no_tmpl = tmp_path / "no-template"
    no_tmpl.mkdir()
    (no_tmpl / "tokenizer.json").write_bytes((tiny_model / "tokenizer.json").read_bytes())
    with pytest.raises(ModelError, match="no chat template"):
        ChatTokenizer(no_tmpl)


def test_long_texts_are_tokenized_with_the_gil_released(tiny_model: Path) -> None:
    """A tool return tokenized in a worker thread must leave the event loop running: the
    main thread keeps counting while another thread encodes 512 KiB (~0.3 s).
    `Tokenizer.encode` held the GIL throughout (2 counts)."""
    import threading

    tok = ChatTokenizer(tiny_model)
    text = "stall words, " * (512 * 1024 // 13)
    ids = tok.encode(text)
    assert ids == tok.tokenizer.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == tok.tokenizer.decode(ids, skip_special_tokens=False) == text

    done = threading.Event()
    worker = threading.Thread(target=lambda: (tok.encode(text), done.set()))
    worker.start()
    counts = 0
    while not done.is_set():
        counts += 1
        done.wait(0.002)  # gives the GIL up, as the loop does between callbacks
    worker.join()
    assert counts >= 10, counts
