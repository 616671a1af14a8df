"""Tokenizer + chat template of a model folder, without transformers or torch.

`ChatTokenizer` renders the opening messages once and, after a tool call, renders only
the *delta*: the tool message(s) plus the generation prompt, exactly as the model's chat
template would write them after an assistant turn. The history is never re-rendered
(templates such as Qwen3's rewrite earlier turns, which would break the token prefix).

The delta is computed against a fixed placeholder conversation:

    base  = render([user, assistant(SENTINEL)])            -> ...SENTINEL<|im_end|>\n
    full  = render([user, assistant(SENTINEL), *tool_msgs],
                   add_generation_prompt=True)             -> base + <|im_start|>user...
    tail  = base after SENTINEL                            -> <|im_end|>\n
    delta = tail + full[len(base):]

When the model's own turn ended with the end-of-turn token (`<|im_end|>`), that token is
already in the context and is cut from the front of `tail`.

The Jinja environment mirrors transformers' (`tojson` without HTML escaping,
`raise_exception`, `strftime_now`, trim_blocks / lstrip_blocks, loop controls).

Tokenizing is proportional to the text (1-2 s per MB here), so callers on an event loop
first bound the token count from the length alone (`min_tokens`: a text that cannot fit
is refused without tokenizing it) and tokenize big texts in worker threads
(`libra.rollout.offload`), each with its own `clone()`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from libra.errors import ModelError

RELEASE_GIL_CHARS = 4096
"""Texts longer than this are tokenized with the GIL released (`ChatTokenizer.encode`)."""

_SENTINEL = "\u2063LIBRA-ASSISTANT-SENTINEL\u2063"


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (HF assistant masks)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


_KEEPING = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend"})


def _keeps_text(spec: dict[str, Any]) -> bool:
    """Whether a normalizer (its JSON) never removes characters beyond bounded ones."""
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_text(n) for n in spec.get("normalizers", []))
    if kind == "Replace":
        return bool(spec.get("content"))
    return kind in _KEEPING


class ChatTokenizer:
    """A model folder's tokenizer and chat template."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise ModelError(
                f"model folder {str(self.model_dir)!r} does not exist; "
                "pass a folder with config.json and tokenizer files (or run `libra make-model DIR`)"
            )
        tok_file = self.model_dir / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelError(
                f"model folder {str(self.model_dir)!r} has no tokenizer.json; "
                "Libra needs a fast (tokenizers) tokenizer file there"
            )
        self.tokenizer = Tokenizer.from_file(str(tok_file))
        cfg_file = self.model_dir / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.chat_template = self._find_template()
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, "jinja2.ext.loopcontrols"],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(self.chat_template)
        except jinja2.TemplateError as e:
            raise ModelError(f"{self.model_dir}: the chat template does not compile: {e}") from None
        self.special_tokens = {
            key: text
            for key in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (text := _token_text(self.config.get(key))) is not None
        }
        self.eos_token = self.special_tokens.get("eos_token")
        self.eos_token_ids = self._eos_ids()
        self._plans: dict[int, tuple[Any, tuple[Any, str, str]]] = {}
        self.chars_per_token = self._chars_per_token()
        """Most characters of input text one token can stand for (None: unknown, when a
        normalizer may delete text)."""

    def clone(self) -> ChatTokenizer:
        """An independent copy (for another thread: a fast tokenizer shared across
        threads can fail with "Already borrowed", and the plan cache is not locked)."""
        return ChatTokenizer(self.model_dir)

    def _chars_per_token(self) -> int | None:
        """Longest vocabulary entry (byte-level BPE: in bytes, which bound characters),
        doubled for normalizers that compose characters (NFC: e + combining accent -> é);
        None when the normalizer may delete text (then no bound holds)."""
        norm = self.tokenizer.normalizer
        if norm is not None and not _keeps_text(json.loads(norm.__getstate__())):
            return None
        longest = max((len(k) for k in self.tokenizer.get_vocab(with_added_tokens=True)), default=0)
        return 2 * max(longest, 1)

    def min_tokens(self, chars: int) -> int:
        """A lower bound on the tokens of any text of `chars` characters (0 if unknown)."""
        return chars // self.chars_per_token if self.chars_per_token else 0

    def _find_template(self) -> str:
        jinja_file = self.model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text()
        tmpl = self.config.get("chat_template")
        if isinstance(tmpl, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
            tmpl = named.get("default") or next(iter(named.values()), None)
        if not isinstance(tmpl, str) or not tmpl:
            raise ModelError(
                f"model folder {str(self.model_dir)!r} has no chat template "
                "(chat_template.jinja or tokenizer_config.json['chat_template'])"
            )
        return tmpl

    def _eos_ids(self) -> list[int]:
        ids: list[int] = []
        gen = self.model_dir / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids += eos if isinstance(eos, list) else ([eos] if isinstance(eos, int) else [])
        if self.eos_token is not None:
            tid = self.tokenizer.token_to_id(self.eos_token)
            if tid is not None and tid not in ids:
                ids.append(tid)
        if not ids:
            raise ModelError(
                f"{self.model_dir}: no eos token in tokenizer_config.json or generation_config.json"
            )
        return ids

    # --- rendering ---------------------------------------------------------------
    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        try:
            return self._template.render(
                messages=list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as e:
            raise ModelError(f"{self.model_dir}: chat template failed: {e}") from None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added). A long text goes through
        `encode_batch`, the same pipeline, which releases the GIL while it works:
        `Tokenizer.encode` holds it throughout (256 KiB, ~130 ms here, in a worker
        thread stopped the event loop for as long)."""
        if len(text) > RELEASE_GIL_CHARS:
            return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """`ids` as text; long lists through `decode_batch`, as `encode` says."""
        skip = skip_special_tokens
        if len(ids) > RELEASE_GIL_CHARS // 4:
            return self.tokenizer.decode_batch([list(ids)], skip_special_tokens=skip)[0]
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip)

    def token_id(self, text: str) -> int | None:
        """The id of `text` when it is a single token of the vocabulary, else None."""
        tid = self.tokenizer.token_to_id(text)
        if tid is not None:
            return tid
        ids = self.encode(text)
        return ids[0] if len(ids) == 1 else None

    def prompt_ids(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        """The opening prompt: messages rendered once, with the generation prompt."""
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def _plan(self, tools: Sequence[dict[str, Any]] | None) -> tuple[Any, str, str]:
        """(tools to render deltas with, base render, tail), cached per tools list.

        Rendering the tool list (JSON of every schema) on each tool turn is most of a
        delta's cost. Many templates (Qwen's among them) only put tools in the system
        block; for those the delta is the same without them, which is checked here on a
        probe message before deltas are rendered without tools.
        """
        key = id(tools)
        hit = self._plans.get(key)
        if hit is not None and hit[0] is tools:
            return hit[1]
        plan = self._make_plan(tools)
        if tools:
            probe = [{"role": "tool", "name": "probe", "content": "probe \u2063 42"}]
            bare = self._make_plan(None)
            if self._delta(probe, bare, True) == self._delta(probe, plan, True):
                plan = bare
        if len(self._plans) > 64:
            self._plans.clear()
        self._plans[key] = (tools, plan)
        return plan

    def _make_plan(self, tools: Sequence[dict[str, Any]] | None) -> tuple[Any, str, str]:
        base_msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
        base = self.render(base_msgs, tools, add_generation_prompt=False)
        at = base.rfind(_SENTINEL)
        if at < 0:
            raise ModelError(f"{self.model_dir}: chat template drops assistant content")
        return tools, base, base[at + len(_SENTINEL) :]

    def _delta(
        self,
        new_messages: Sequence[dict[str, Any]],
        plan: tuple[Any, str, str],
        model_closed_turn: bool,
    ) -> str:
        tools, base, tail = plan
        base_msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
        full = self.render([*base_msgs, *new_messages], tools, add_generation_prompt=True)
        if not full.startswith(base):
            raise ModelError(
                f"{self.model_dir}: chat template re-renders the assistant turn when "
                "tool messages follow; cannot append a delta"
            )
        if model_closed_turn and self.eos_token and tail.startswith(self.eos_token):
            tail = tail[len(self.eos_token) :]
        return tail + full[len(base) :]

    def delta_text(
        self,
        new_messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        model_closed_turn: bool = True,
    ) -> str:
        """Text to append after an assistant turn: its closing, `new_messages` (tool or
        user messages), and the generation prompt. `model_closed_turn`: the model's last
        token was the end-of-turn token (so it is not repeated)."""
        return self._delta(new_messages, self._plan(tools), model_closed_turn)

    def delta_ids(
        self,
        new_messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        model_closed_turn: bool = True,
    ) -> list[int]:
        return self.encode(self.delta_text(new_messages, tools, model_closed_turn))


__all__ = ["ChatTokenizer"]
