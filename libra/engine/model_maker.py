"""`libra make-model`: write a tiny Qwen2 model folder offline, deterministic for a seed.

No weights can be downloaded, so Libra's default model is made here: a Qwen2ForCausalLM
config small enough to serve fast on one CPU core (but shaped for vLLM's CPU backend:
head_dim 64, 4 query heads and 2 KV heads, so TP=2 splits evenly), seeded random float32
weights in `model.safetensors`, a byte-level BPE tokenizer trained locally
(`tokenizer_maker`), and a Qwen2.5-style chat template with tools. The folder loads with
`transformers.AutoTokenizer` / `AutoModelForCausalLM` and with vLLM.

The weights depend on the seed; the tokenizer and template do not, so checkpoints of
different seeds are interchangeable for a weight update. Same seed, same bytes.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from libra.engine.tokenizer_maker import SPECIAL_TOKENS, TAG_TOKENS, train_tokenizer
from libra.errors import ConfigError
from libra.paths import holds_working_folder, user_cache

# Bump when the folder's contents change, so a cached default model is remade.
MAKER_VERSION = 2
CHAT_TEMPLATE = (Path(__file__).parent / "chat_template.jinja").read_text()
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class TinyQwen2:
    """Sizes of the tiny model (Qwen2 architecture)."""

    vocab_size: int = 4096
    """Total ids: the trained BPE plus the 11 added tokens, exactly."""
    hidden_size: int = 256
    """Model width; head_dim = hidden_size / num_attention_heads = 64."""
    intermediate_size: int = 512
    """SwiGLU MLP width."""
    num_hidden_layers: int = 4
    """Transformer blocks."""
    num_attention_heads: int = 4
    """Query heads (even, so tensor parallel 2 splits them)."""
    num_key_value_heads: int = 2
    """KV heads (grouped-query attention; even for TP=2)."""
    max_position_embeddings: int = 4096
    """Context length served by the engines."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    init_std: float = 0.05
    """Std of the random init of the projection matrices."""
    embed_std: float = 0.15
    """Std of the embedding and the output layer (untied). Large, so the output
    distribution is peaked and greedy choices are separated by clear margins: engines
    that differ in float rounding (embedded, transformers, vLLM, TP=2) agree."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")


def default_model_dir(seed: int = 0) -> Path:
    """Where `serve-engine` keeps the default model: the user cache."""
    return user_cache("models", f"tiny-qwen2-v{MAKER_VERSION}-s{seed}")


def ensure_default_model(seed: int = 0) -> Path:
    """The default model folder, made on first use. Safe when processes race: each
    writes a private temp folder and renames it into place; the first rename wins."""
    path = default_model_dir(seed)
    if _complete(path):
        return path
    return make_model(path, seed=seed, force=False, exist_ok=True)


def make_model(
    path: str | Path,
    *,
    seed: int = 0,
    sizes: TinyQwen2 | None = None,
    force: bool = False,
    exist_ok: bool = False,
) -> Path:
    """Write the tiny model folder at `path` and return it.

    An existing non-empty folder is an error unless `force` (replace it) or `exist_ok`
    with a complete model there (keep it). The folder appears atomically.
    """
    # resolved: `a/b/..` is `a`, so the temporary folder made beside it is not inside
    # the folder `force` replaces (`sb/a/b/.. --force` emptied sb/a and made nothing)
    path = Path(path).expanduser().resolve()
    sizes = sizes or TinyQwen2()
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        if exist_ok and _complete(path):
            return path
        if not force:
            raise ConfigError(
                f"{path} exists and is not empty; pass --force to replace it or pick a new folder"
            )
        check_replaceable(path)
    tmp = temp_beside(path)
    try:
        _write(tmp, seed, sizes)
        if force and path.exists():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        try:
            tmp.rename(path)
        except OSError:
            # Another process renamed its copy first (exist_ok): keep theirs.
            if not (exist_ok and _complete(path)):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def temp_beside(path: Path) -> Path:
    """A fresh folder beside `path` (its folder made) to write a model in and rename to
    `path` once whole; a `ConfigError` when that cannot be made."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    except OSError as e:
        raise ConfigError(f"{path}: its folder cannot be made or written ({e.strerror or e}); "
                          "give a path this user can write") from None  # fmt: skip


def check_replaceable(path: Path) -> None:
    """A `ConfigError` unless `--force` may replace the existing `path` (resolved): a
    file, or a model folder (it has a `config.json`), never the working folder or one
    above it (a home, `/`: `--force` replaced whatever it named)."""
    if holds_working_folder(path):
        raise ConfigError(f"{path} is the working folder or holds it; pick a new folder")
    if path.is_dir() and not (path / "config.json").is_file():
        names = ", ".join(sorted(p.name for p in path.iterdir())[:4])
        raise ConfigError(f"{path} is not a model folder ({names}); --force replaces only "
                          "a model folder: pick a new folder")  # fmt: skip


def _complete(path: Path) -> bool:
    return all((path / name).is_file() for name in FILES)


def _write(folder: Path, seed: int, sizes: TinyQwen2) -> None:
    tok = train_tokenizer(sizes.vocab_size)
    ids: dict[str, int] = {}
    for t in (*SPECIAL_TOKENS, *TAG_TOKENS):
        tid = tok.token_to_id(t)
        assert tid is not None, t  # added just above by train_tokenizer
        ids[t] = tid
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    tok.save(str(folder / "tokenizer.json"))
    _dump(folder / "config.json", _config(sizes, eos))
    _dump(folder / "generation_config.json", {"eos_token_id": [eos, pad], "pad_token_id": pad})
    _dump(folder / "tokenizer_config.json", _tokenizer_config(ids, sizes))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    _write_weights(folder / "model.safetensors", sizes, seed)


def _dump(path: Path, doc: dict) -> None:
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def _config(s: TinyQwen2, eos: int) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **{k: v for k, v in asdict(s).items() if k not in ("init_std", "embed_std")},
        "head_dim": s.hidden_size // s.num_attention_heads,
        "hidden_act": "silu",
        "initializer_range": s.init_std,
        "attention_dropout": 0.0,
        # Untied: vLLM 0.32's in-place weight reload skips a tied lm_head
        # ("ParallelLMHead: Failed to load weights"), so a tied model would keep its old
        # output layer after an update.
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": s.num_hidden_layers,
        "bos_token_id": None,
        "eos_token_id": eos,
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
        "libra_maker_version": MAKER_VERSION,
    }


def _tokenizer_config(ids: dict[str, int], s: TinyQwen2) -> dict:
    decoder = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t, i in ids.items()
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": s.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_weights(path: Path, s: TinyQwen2, seed: int) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    head_dim = s.hidden_size // s.num_attention_heads
    kv = s.num_key_value_heads * head_dim
    h, m = s.hidden_size, s.intermediate_size

    def normal(*shape: int, std: float = s.init_std) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(s.vocab_size, h, std=s.embed_std)}
    for i in range(s.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": normal(h, h),
            p + "self_attn.q_proj.bias": normal(h),
            p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.k_proj.bias": normal(kv),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.bias": normal(kv),
            p + "self_attn.o_proj.weight": normal(h, h),
            p + "mlp.gate_proj.weight": normal(m, h),
            p + "mlp.up_proj.weight": normal(m, h),
            p + "mlp.down_proj.weight": normal(h, m),
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
        }
    tensors["model.norm.weight"] = np.ones(h, np.float32)
    tensors["lm_head.weight"] = normal(s.vocab_size, h, std=s.embed_std)
    save_file(tensors, str(path), metadata={"format": "pt"})


__all__ = ["FILES", "TinyQwen2", "default_model_dir", "ensure_default_model", "make_model"]
