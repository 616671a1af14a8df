"""A Qwen2 / Llama decoder in plain PyTorch, with a batched KV cache.

The embedded engine runs this instead of transformers' model classes: one prefill per new
sequence, then one batched decode step for all running sequences, attention over a shared
cache tensor with a per-row length mask. Weights come from the folder's safetensors
in the checkpoint's dtype (`dtype="auto"`: float32 for the tiny model, bfloat16 for
SmolLM2; bf16 matmuls run on AMX/AVX-512-BF16 at about twice the fp32 speed) or the one
asked for; logits are always upcast to float32 for sampling and logprobs. QKV and
gate/up projections are fused so a step is a handful of matmuls.
Supported: `Qwen2ForCausalLM` (QKV bias) and `LlamaForCausalLM` (SmolLM2), tied or untied
embeddings, grouped-query attention, default RoPE.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from libra.errors import ModelError

ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The fields of a model folder's config.json that the engine needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    dtype: torch.dtype
    """Compute dtype (weights, activations, KV cache)."""

    @classmethod
    def load(cls, folder: Path, dtype: str = "auto") -> ModelConfig:
        """`dtype`: "auto" (the checkpoint's), "float32" or "bfloat16"."""
        path = folder / "config.json"
        if not path.is_file():
            raise ModelError(f"{folder} has no config.json; is this a model folder?")
        try:
            c = json.loads(path.read_text())
        except (ValueError, OSError) as e:  # not JSON, not UTF-8, unreadable
            raise ModelError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(c, dict):
            raise ModelError(f"{path}: not a JSON object")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "max_position_embeddings"):  # fmt: skip
            value = c.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                # a KeyError or a ZeroDivisionError traceback, or (0 layers) an engine
                # that served a model without its layers
                raise ModelError(f"{path}: {key} is {value!r}; expected a whole number >= 1")
        arch = (c.get("architectures") or ["?"])[0]
        if arch not in ARCHITECTURES:
            raise ModelError(
                f"{folder}: architecture {arch!r} is not supported by the embedded engine "
                f"(supported: {', '.join(ARCHITECTURES)}); serve it with vLLM instead"
            )
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ModelError(f"{folder}: RoPE scaling {rope!r} is not supported")
        heads = c["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta") or c.get("rope_theta") or 10000.0),
            max_position_embeddings=c["max_position_embeddings"],
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(c.get("attention_bias", False)),
            dtype=_dtype(folder, dtype, c.get("dtype") or c.get("torch_dtype")),
        )


def _dtype(folder: Path, asked: str, checkpoint: str | None) -> torch.dtype:
    name = checkpoint if asked == "auto" else asked
    if name in (None, "float32", "float16"):  # fp16 runs as fp32 on CPU
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    raise ModelError(f"{folder}: dtype {name!r} is not supported (use float32 or bfloat16)")


def load_weights(folder: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The folder's tensors in `cfg.dtype`, fused into the layout `Decoder` uses."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{folder} has no *.safetensors weights")
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        raw.update(load_file(str(f)))
    try:
        return fuse(raw, cfg)
    except KeyError as e:
        raise ModelError(f"{folder}: weight {e.args[0]} is missing") from None
    except ModelError as e:
        raise ModelError(f"{folder}: {e}") from None


def fuse(raw: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """`raw` (HF names) in the decoder's layout. A tensor whose shape is not the one
    config.json gives is refused here, naming both: the forward pass would fail at the
    first request, or (a projection's inner size) serve another model than the config
    says."""
    hidden, vocab, inner = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"q": (q, hidden), "k": (kv, hidden), "v": (kv, hidden)}

    def get(name: str, *shape: int) -> torch.Tensor:
        t = raw[name]
        if tuple(t.shape) != shape:
            raise ModelError(
                f"weight {name} has shape {list(t.shape)}, but config.json's sizes give "
                f"{list(shape)}: the weights and config.json are of different models"
            )
        return t.to(cfg.dtype).contiguous()

    w = {"embed": get("model.embed_tokens.weight", vocab, hidden),
         "norm": get("model.norm.weight", hidden)}  # fmt: skip
    w["lm_head"] = w["embed"] if cfg.tie_word_embeddings else get("lm_head.weight", vocab, hidden)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        w[f"{i}.qkv"] = torch.cat([get(a + f"{x}_proj.weight", *shapes[x]) for x in "qkv"])
        if cfg.qkv_bias:
            w[f"{i}.qkv_b"] = torch.cat([get(a + f"{x}_proj.bias", shapes[x][0]) for x in "qkv"])
        w[f"{i}.o"] = get(a + "o_proj.weight", hidden, q)
        w[f"{i}.gate_up"] = torch.cat(
            [get(p + "mlp.gate_proj.weight", inner, hidden),
             get(p + "mlp.up_proj.weight", inner, hidden)]
        )  # fmt: skip
        w[f"{i}.down"] = get(p + "mlp.down_proj.weight", hidden, inner)
        w[f"{i}.ln1"] = get(p + "input_layernorm.weight", hidden)
        w[f"{i}.ln2"] = get(p + "post_attention_layernorm.weight", hidden)
    return w


class KVCache:
    """Keys and values of the running sequences: one tensor per layer,
    `[rows, kv_heads, capacity, head_dim]`. Row r belongs to one sequence; both dims
    grow by doubling. Rows stay packed (`move_row` fills a hole from the end)."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.rows = 0
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def ensure(self, rows: int, length: int) -> None:
        if rows <= self.rows and length <= self.capacity:
            return
        new_rows = max(rows, self.rows, 1)
        new_rows = 1 << (new_rows - 1).bit_length() if new_rows > self.rows else self.rows
        new_cap = max(length, self.capacity, 16)
        new_cap = 1 << (new_cap - 1).bit_length() if new_cap > self.capacity else self.capacity
        shape = (new_rows, self.cfg.num_kv_heads, new_cap, self.cfg.head_dim)
        ks, vs = [], []
        for layer in range(self.cfg.num_layers):
            dt = self.cfg.dtype
            k, v = torch.zeros(shape, dtype=dt), torch.zeros(shape, dtype=dt)
            if self.rows:
                k[: self.rows, :, : self.capacity] = self.k[layer]
                v[: self.rows, :, : self.capacity] = self.v[layer]
            ks.append(k)
            vs.append(v)
        self.k, self.v, self.rows, self.capacity = ks, vs, new_rows, new_cap

    def move_row(self, src: int, dst: int, length: int) -> None:
        for t in (*self.k, *self.v):
            t[dst, :, :length] = t[src, :, :length]

    def bytes_for(self, rows: int, length: int) -> int:
        c = self.cfg
        size = torch.finfo(c.dtype).bits // 8
        return 2 * c.num_layers * rows * c.num_kv_heads * length * c.head_dim * size

    def clear(self) -> None:
        self.__init__(self.cfg)  # type: ignore[misc]


class Decoder:
    """Forward passes over fused weights; swap `weights` to load a new checkpoint."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.weights = weights
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        freqs = torch.outer(torch.arange(cfg.max_position_embeddings).float(), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos().to(cfg.dtype), emb.sin().to(cfg.dtype)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # x: [..., T, D] with pos broadcastable to [..., T]
        cos, sin = self.cos[pos].unsqueeze(-3), self.sin[pos].unsqueeze(-3)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _block_in(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c, w = self.cfg, self.weights
        h = F.rms_norm(x, (c.hidden_size,), w[f"{i}.ln1"], c.rms_norm_eps)
        qkv = F.linear(h, w[f"{i}.qkv"], w.get(f"{i}.qkv_b"))
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return qkv.split([q_size, kv_size, kv_size], dim=-1)

    def _block_out(self, i: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        c, w = self.cfg, self.weights
        x = x + F.linear(attn, w[f"{i}.o"])
        h = F.rms_norm(x, (c.hidden_size,), w[f"{i}.ln2"], c.rms_norm_eps)
        gate, up = F.linear(h, w[f"{i}.gate_up"]).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, w[f"{i}.down"])

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weights
        x = F.rms_norm(x, (self.cfg.hidden_size,), w["norm"], self.cfg.rms_norm_eps)
        return F.linear(x, w["lm_head"])

    @torch.inference_mode()
    def prefill(self, tokens: list[int], cache: KVCache, row: int) -> torch.Tensor:
        """Run one prompt, write its keys/values into `row`; the last position's logits."""
        c = self.cfg
        n = len(tokens)
        pos = torch.arange(n)
        x = F.embedding(torch.tensor(tokens), self.weights["embed"])
        for i in range(c.num_layers):
            q, k, v = self._block_in(i, x)
            q = self._rope(q.view(n, c.num_heads, c.head_dim).transpose(0, 1), pos)
            k = self._rope(k.view(n, c.num_kv_heads, c.head_dim).transpose(0, 1), pos)
            v = v.view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
            cache.k[i][row, :, :n] = k
            cache.v[i][row, :, :n] = v
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = self._block_out(i, x, a.transpose(0, 1).reshape(n, -1))
        return self._logits(x[-1]).float()

    @torch.inference_mode()
    def decode(self, tokens: list[int], lengths: list[int], cache: KVCache) -> torch.Tensor:
        """One token for each of rows 0..B-1 (row b holds `lengths[b]` tokens so far);
        returns logits `[B, vocab]`."""
        c = self.cfg
        b = len(tokens)
        pos = torch.tensor(lengths)
        rows = torch.arange(b)
        span = max(lengths) + 1
        mask = (torch.arange(span).unsqueeze(0) <= pos.unsqueeze(1)).view(b, 1, 1, span)
        x = F.embedding(torch.tensor(tokens), self.weights["embed"])
        for i in range(c.num_layers):
            q, k, v = self._block_in(i, x)
            q = self._rope(q.view(b, c.num_heads, 1, c.head_dim), pos.view(b, 1))
            k = self._rope(k.view(b, c.num_kv_heads, 1, c.head_dim), pos.view(b, 1))
            cache.k[i][rows, :, pos] = k.squeeze(2)
            cache.v[i][rows, :, pos] = v.view(b, c.num_kv_heads, c.head_dim)
            keys, values = cache.k[i][:b, :, :span], cache.v[i][:b, :, :span]
            a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            x = self._block_out(i, x, a.reshape(b, -1))
        return self._logits(x).float()


__all__ = ["ARCHITECTURES", "Decoder", "KVCache", "ModelConfig", "load_weights"]
