"""`libra make-model`: a tiny Qwen2 folder that transformers loads, deterministic per seed."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from libra.engine.model_maker import FILES, default_model_dir, make_model
from libra.engine.tokenizer_maker import SPECIAL_TOKENS, TAG_TOKENS
from libra.errors import ConfigError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the corpus.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Who wrote Hamlet? Use <tools> if needed."},
    {
        "role": "assistant",
        "content": "<think>\nlook it up\n</think>",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "search", "arguments": {"query": "Hamlet author"}},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "search", "arguments": '{"query": "Shakespeare"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "Shakespeare wrote Hamlet."},
    {"role": "tool", "tool_call_id": "c2", "content": "Born 1564."},
    {"role": "assistant", "content": "<answer>Shakespeare</answer>"},
]


def _digests(folder: Path) -> dict[str, str]:
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in FILES}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("m") / "tiny", seed=0)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def test_same_seed_same_bytes_other_seed_other_weights_same_tokenizer(model_dir, tmp_path):
    again = make_model(tmp_path / "again", seed=0)
    other = make_model(tmp_path / "other", seed=1)
    assert _digests(again) == _digests(model_dir)
    d0, d1 = _digests(model_dir), _digests(other)
    assert d0["model.safetensors"] != d1["model.safetensors"]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        assert d0[name] == d1[name], name


def test_config_fits_vllm_cpu_and_tensor_parallel_2(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["hidden_size"] // cfg["num_attention_heads"] in (32, 64)
    assert cfg["num_attention_heads"] % 2 == 0 and cfg["num_key_value_heads"] % 2 == 0
    assert cfg["max_position_embeddings"] >= 4096
    gen = json.loads((model_dir / "generation_config.json").read_text())
    tcfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tcfg["eos_token"] == "<|im_end|>" and tcfg["pad_token"] == "<|endoftext|>"
    assert tcfg["bos_token"] is None
    assert tcfg["chat_template"] == (model_dir / "chat_template.jinja").read_text()
    assert cfg["eos_token_id"] in gen["eos_token_id"]


def test_loads_with_transformers_and_generates_deterministically(model_dir, hf_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    cfg = json.loads((model_dir / "config.json").read_text())
    assert len(hf_tokenizer) == cfg["vocab_size"]
    ids = hf_tokenizer("The answer is 42.", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg["vocab_size"])
    out1 = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    out2 = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert out1.tolist() == out2.tolist()
    assert out1.shape[1] == len(ids) + 8


def test_added_tokens_are_single_ids_specials_skippable_tags_kept(hf_tokenizer):
    ids = {}
    for t in (*SPECIAL_TOKENS, *TAG_TOKENS):
        enc = hf_tokenizer.encode(t, add_special_tokens=False)
        assert len(enc) == 1, t
        ids[t] = enc[0]
    assert len(set(ids.values())) == len(ids)
    assert hf_tokenizer.eos_token_id == ids["<|im_end|>"]
    assert hf_tokenizer.pad_token_id == ids["<|endoftext|>"]
    text = '<|im_start|>assistant\n<tool_call>\n{"name": "x"}\n</tool_call><|im_end|>'
    enc = hf_tokenizer.encode(text, add_special_tokens=False)
    assert hf_tokenizer.decode(enc, skip_special_tokens=False) == text
    assert hf_tokenizer.decode(enc, skip_special_tokens=True) == (
        'assistant\n<tool_call>\n{"name": "x"}\n</tool_call>'
    )


def test_tokenizer_round_trips_text_code_json_and_unicode(model_dir, hf_tokenizer):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = (
        "Résumé: 3.14159 × 2 = 6.28!\n\tdef f(x):\n        return {'a': [1, 2]}\n"
        '{"name": "search", "arguments": {"query": "日本 🚀"}}  trailing  '
    )
    enc = hf_tokenizer.encode(text, add_special_tokens=False)
    assert enc == raw.encode(text, add_special_tokens=False).ids
    assert hf_tokenizer.decode(enc) == text
    # Common English compresses well below one token per character.
    sentence = "The researchers reconstructed the important system."
    assert len(hf_tokenizer.encode(sentence, add_special_tokens=False)) < len(sentence) / 3


def test_chat_template_renders_qwen25_tools_and_never_rewrites_history(hf_tokenizer):
    def render(msgs, gen=False):
        return hf_tokenizer.apply_chat_template(
            msgs, tools=TOOLS, tokenize=False, add_generation_prompt=gen
        )

    full = render(CONVERSATION)
    assert full.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in full
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' in full
    assert (
        "<|im_start|>assistant\n<think>\nlook it up\n</think>\n"
        '<tool_call>\n{"name": "search", "arguments": {"query": "Hamlet author"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"query": "Shakespeare"}}\n</tool_call>'
        "<|im_end|>\n"
    ) in full
    assert (
        "<|im_start|>user\n<tool_response>\nShakespeare wrote Hamlet.\n</tool_response>\n"
        "<tool_response>\nBorn 1564.\n</tool_response><|im_end|>\n"
    ) in full
    assert full.endswith("<|im_start|>assistant\n<answer>Shakespeare</answer><|im_end|>\n")
    # Prefix property: each turn renders once and is never rewritten by later turns.
    for k in (2, 3, 5):
        assert full.startswith(render(CONVERSATION[:k]))
    assert render(CONVERSATION[:5], gen=True) == render(CONVERSATION[:5]) + (
        "<|im_start|>assistant\n"
    )
    # The rendered text tokenizes and decodes back unchanged.
    enc = hf_tokenizer.encode(full, add_special_tokens=False)
    assert hf_tokenizer.decode(enc) == full


def test_no_tools_no_system_has_no_default_system_prompt(hf_tokenizer):
    text = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_libra_chat_renders_like_transformers(model_dir, hf_tokenizer):
    from libra.chat import ChatTokenizer
    from libra.toolcalls import HermesParser

    chat = ChatTokenizer(model_dir)
    expected = hf_tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert chat.render(CONVERSATION, TOOLS, add_generation_prompt=False) == expected
    assert chat.eos_token_ids[0] == hf_tokenizer.eos_token_id
    calls = HermesParser().parse(chat.render(CONVERSATION[2:3], add_generation_prompt=False))
    assert [(c.name, c.arguments) for c in calls] == [
        ("search", {"query": "Hamlet author"}),
        ("search", {"query": "Shakespeare"}),
    ]


def test_existing_folder_needs_force_and_only_a_model_is_replaced(tmp_path):
    """`--force` replaced whatever the path named, and `sb/a/b/.. --force` (the path not
    resolved: the temporary folder inside the one it replaced) emptied `sb/a` and wrote
    no model. Now only a model folder is replaced, and the path is resolved first."""
    target = tmp_path / "m"
    make_model(target)
    (target / "extra.txt").write_text("x")
    with pytest.raises(ConfigError, match="--force"):
        make_model(target)
    make_model(target, force=True)
    assert not (target / "extra.txt").exists()
    assert all((target / f).is_file() for f in FILES)
    notes = tmp_path / "notes"
    (notes / "b").mkdir(parents=True)
    (notes / "keep.txt").write_text("mine")
    for path in (notes, notes / "b" / ".."):
        with pytest.raises(ConfigError, match="is not a model folder"):
            make_model(path, force=True)
    assert (notes / "keep.txt").read_text() == "mine" and (notes / "b").is_dir()
    with pytest.raises(ConfigError, match="cannot be made or written"):
        make_model(notes / "keep.txt" / "sub")


def test_cli_make_model_and_bad_input(tmp_path):
    libra = [sys.executable, "-m", "libra"]
    ok = subprocess.run(
        [*libra, "make-model", str(tmp_path / "m"), "--seed", "3", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["seed"] == 3
    again = subprocess.run(
        [*libra, "make-model", str(tmp_path / "m")], capture_output=True, text=True, check=False
    )
    assert again.returncode == 2
    assert again.stderr.count("\n") == 1 and "--force" in again.stderr
    assert "Traceback" not in again.stderr


def test_default_model_made_once_when_two_processes_race(tmp_path, monkeypatch):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    code = (
        "from libra.engine.model_maker import ensure_default_model; print(ensure_default_model())"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1]
    folder = Path(outs[0])
    assert folder.parent == tmp_path / "libra" / "models"
    assert all((folder / f).is_file() for f in FILES)
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temp leftovers
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_model_dir() == folder


@pytest.mark.parametrize(
    ("key", "factor", "weight"),
    [("intermediate_size", 2, "mlp.gate_proj.weight"), ("hidden_size", 2, "embed_tokens")],
)
def test_weights_of_other_sizes_than_config_json_are_refused_at_load(
    model_dir, tmp_path, key, factor, weight
):
    """A folder whose config.json and weights disagree is refused when the engine loads
    it, naming the weight: an inner size the forward pass never reads served another
    model than the config said, and a hidden size failed at the first request."""
    import shutil

    from libra.engine.model import ModelConfig, load_weights
    from libra.errors import ModelError

    folder = tmp_path / "mixed"
    shutil.copytree(model_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg[key] *= factor
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=rf"{weight}.* has shape .* config\.json's sizes give"):
        load_weights(folder, ModelConfig.load(folder))
    assert load_weights(model_dir, ModelConfig.load(model_dir))  # the model itself loads
