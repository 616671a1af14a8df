"""Hardware and model profiles: plain numbers, loaded from data files that cite sources.

Built-in profiles live in `libra/planner/data/{hardware,models}/<id>.toml`; each number has
a line in the file's `[sources]` table. A hardware profile can also be a path to such a
file (or come from `libra.planner.calibrate.calibrate_local`); a model can also be a
folder holding a Hugging Face `config.json`.

Units inside the code are SI: bytes, seconds, FLOP/s, bytes/s. The data files use the
units vendors print (GiB, TB/s, TFLOP/s, GB/s) and are converted once, here.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from libra.errors import ConfigError

GIB = 1024**3


@dataclass(frozen=True, slots=True, kw_only=True)
class Efficiency:
    """Achieved fractions of peak and fixed latencies (what datasheets do not give)."""

    hbm: float = 0.8
    """Fraction of peak HBM bandwidth a decode step achieves."""
    comm: float = 0.75
    """Fraction of link bandwidth a large collective achieves."""
    train_mfu: float = 0.5
    """Model FLOP utilisation of a training step (compute only; communication is modelled)."""
    prefill_mfu: float = 0.6
    """FLOP utilisation of inference compute (prefill chunks, compute-bound decode)."""
    allreduce_latency_s: float = 30e-6
    """Fixed cost of one all-reduce (small messages are latency-bound)."""
    p2p_latency_s: float = 10e-6
    """Fixed cost of one point-to-point send (pipeline stages)."""
    step_overhead_s: float = 1e-3
    """Engine time per decode step outside the model (scheduling, sampling, launches)."""
    seq_overhead_s: float = 0.0
    """Engine time per sequence of a decode step outside the model's FLOPs and bytes
    (sampling over the vocabulary, per-sequence bookkeeping and detokenisation). 0 in
    the datasheet profiles; `libra profile` measures it (docs/cost-model.md)."""

    def __post_init__(self) -> None:
        # A NaN fraction hung `libra plan`; a negative overhead printed negative times.
        for name in ("hbm", "comm", "train_mfu", "prefill_mfu"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"efficiency {name} must be a finite number > 0")
        for name in ("allreduce_latency_s", "p2p_latency_s", "step_overhead_s",
                     "seq_overhead_s"):  # fmt: skip
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"efficiency {name} must be a finite number >= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class HardwareProfile:
    """One accelerator type and the node it sits in."""

    id: str
    name: str
    memory_bytes: float
    hbm_bandwidth: float
    """Peak memory bandwidth of one device, bytes/s."""
    flops: float
    """Dense BF16 peak of one device, FLOP/s."""
    intra_node_bandwidth: float
    """Per-device, per-direction bandwidth to the other devices of its node, bytes/s."""
    intra_node_topology: str = "switch"
    """`switch` (NVSwitch: any group gets the full per-device rate) or `mesh` (direct links:
    a group of t devices uses t-1 of the devices_per_node-1 links)."""
    inter_node_bandwidth: float
    """Per-device, per-direction network bandwidth between nodes, bytes/s."""
    devices_per_node: int
    eff: Efficiency = field(default_factory=Efficiency)
    sources: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "hbm_bandwidth", "flops", "inter_node_bandwidth"):
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"hardware {self.id!r}: {name} must be a finite number > 0")
        if self.devices_per_node < 1:
            raise ConfigError(f"hardware {self.id!r}: devices_per_node must be >= 1")
        if not 0 <= self.intra_node_bandwidth < math.inf or (
            self.devices_per_node > 1 and self.intra_node_bandwidth == 0
        ):
            raise ConfigError(f"hardware {self.id!r}: intra_node_bandwidth must be a finite "
                              "number, > 0 with more than one device a node")  # fmt: skip
        if self.intra_node_topology not in ("switch", "mesh"):
            raise ConfigError(
                f"hardware {self.id!r}: intra_node_topology must be 'switch' or 'mesh'"
            )

    def group_bandwidth(self, group: int, *, spans_nodes: bool) -> float:
        """Achieved per-device bandwidth of a collective over `group` devices, bytes/s."""
        if spans_nodes:
            return self.inter_node_bandwidth * self.eff.comm
        bw = self.intra_node_bandwidth
        if self.intra_node_topology == "mesh" and self.devices_per_node > 1:
            bw *= (group - 1) / (self.devices_per_node - 1)
        return bw * self.eff.comm


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelProfile:
    """A decoder-only transformer (GQA attention, SwiGLU MLP or MoE), bf16 weights."""

    id: str
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    max_context: int = 32768
    experts: int = 0
    """Routed experts per MoE layer (0: dense)."""
    experts_active: int = 0
    """Experts each token is routed to."""
    moe_intermediate: int = 0
    dtype_bytes: int = 2
    sources: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model {self.id!r}: {name} must be >= 1")
        if self.heads % self.kv_heads:
            raise ConfigError(f"model {self.id!r}: heads must be a multiple of kv_heads")
        if self.experts and not (0 < self.experts_active <= self.experts):
            raise ConfigError(f"model {self.id!r}: experts_active must be in 1..experts")
        if self.experts and self.moe_intermediate < 1:
            raise ConfigError(f"model {self.id!r}: an MoE model needs moe_intermediate")
        if not self.experts and self.intermediate < 1:
            raise ConfigError(f"model {self.id!r}: intermediate must be >= 1")

    # --- parameter counts -----------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def attn_params_per_layer(self) -> int:
        # q, k, v, o projections (no biases) + two RMSNorms + q/k norms.
        h = self.hidden
        return h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h + 2 * h + 2 * self.head_dim

    @property
    def expert_params(self) -> int:
        """One expert's SwiGLU (gate, up, down)."""
        return 3 * self.hidden * self.moe_intermediate

    @property
    def mlp_params_per_layer(self) -> int:
        if self.is_moe:
            return self.experts * self.expert_params + self.hidden * self.experts  # + router
        return 3 * self.hidden * self.intermediate

    @property
    def embedding_params(self) -> int:
        """Input embedding plus the LM head when it is not tied."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def params_total(self) -> int:
        per_layer = self.attn_params_per_layer + self.mlp_params_per_layer
        return self.layers * per_layer + self.embedding_params + self.hidden

    @property
    def expert_params_total(self) -> int:
        return self.layers * self.experts * self.expert_params if self.is_moe else 0

    @property
    def params_active(self) -> int:
        """Parameters one token touches (all of them for a dense model)."""
        if not self.is_moe:
            return self.params_total
        unused = self.layers * (self.experts - self.experts_active) * self.expert_params
        return self.params_total - unused

    @property
    def weight_bytes(self) -> int:
        return self.params_total * self.dtype_bytes

    # --- per-token costs ---------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer (unsharded)."""
        return 2 * self.layers * self.kv_dim * self.dtype_bytes

    @property
    def flops_per_token(self) -> float:
        """Forward matmul FLOPs of one token, excluding attention over the context: twice
        the active parameters, less the embedding lookup (not a matmul), plus the LM head
        (a matmul even when tied)."""
        return 2.0 * (self.params_active - self.embedding_params + self.vocab * self.hidden)

    @property
    def attn_flops_per_pair(self) -> float:
        """Forward FLOPs of one (query, key) pair: QK^T and AV, 2 x q_dim each, per layer."""
        return 4.0 * self.layers * self.q_dim

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "params_b": round(self.params_total / 1e9, 2),
            "active_params_b": round(self.params_active / 1e9, 2),
            "kv_kib_per_token": round(self.kv_bytes_per_token / 1024, 1),
        }

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], *, id: str, name: str = "") -> ModelProfile:
        """Read the fields of a Hugging Face `config.json` (Llama/Qwen/Mistral-style)."""
        if not isinstance(config, Mapping):
            raise ConfigError(f"model {id!r}: config.json is not a JSON object")
        cfg = config.get("text_config") or config
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"model {id!r}: config.json's text_config is not an object")
        if "kv_lora_rank" in cfg:
            raise ConfigError(
                f"model {id!r}: multi-head latent attention (kv_lora_rank) is not modelled; "
                "use a GQA model or add a profile"
            )

        def whole(key: str, default: int | None = None) -> int:
            """`cfg[key]` as a count: an int (or a float with no fraction), else one error
            naming it ("abc", null, NaN or 2.9 were tracebacks or silently cut)."""
            value = cfg.get(key)
            if value is None or (value == 0 and default is not None):
                if default is None:
                    raise ConfigError(f"model {id!r}: config.json lacks {key!r}")
                return default
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or (isinstance(value, float) and not value.is_integer())
            ):
                raise ConfigError(f"model {id!r}: config.json's {key} is {value!r}; "
                                  "expected a whole number")  # fmt: skip
            return int(value)

        hidden, heads = whole("hidden_size"), whole("num_attention_heads")
        if heads < 1:
            raise ConfigError(f"model {id!r}: num_attention_heads must be >= 1 (got {heads})")
        experts = whole("num_experts", 0) or whole("num_local_experts", 0)
        experts = experts or whole("n_routed_experts", 0)
        return cls(
            id=id,
            name=name or id,
            layers=whole("num_hidden_layers"),
            hidden=hidden,
            heads=heads,
            kv_heads=whole("num_key_value_heads", heads),
            head_dim=whole("head_dim", hidden // heads),
            intermediate=whole("intermediate_size", 0),
            vocab=whole("vocab_size"),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_context=whole("max_position_embeddings", 32768),
            experts=experts,
            experts_active=whole("num_experts_per_tok", 0) if experts else 0,
            moe_intermediate=whole("moe_intermediate_size", 0) if experts else 0,
            sources={"config": "config.json"},
        )


# --- loading ------------------------------------------------------------------------------
def _data_dir(kind: str) -> Any:
    return resources.files("libra.planner").joinpath("data", kind)


def known_hardware() -> list[str]:
    """Ids of the built-in hardware profiles, plus `local` (calibrated on this machine)."""
    return sorted(
        p.name[:-5] for p in _data_dir("hardware").iterdir() if p.name.endswith(".toml")
    ) + ["local"]


def known_models() -> list[str]:
    return sorted(p.name[:-5] for p in _data_dir("models").iterdir() if p.name.endswith(".toml"))


def _read_toml(text: str, where: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}: not valid TOML: {e}") from None


def hardware_from_dict(data: Mapping[str, Any], where: str = "") -> HardwareProfile:
    """Build a profile from the data-file layout (vendor units)."""
    d = dict(data)
    e = dict(d.pop("efficiency", {}) or {})
    sources = dict(d.pop("sources", {}) or {})
    try:
        eff = Efficiency(
            hbm=float(e.get("hbm", 0.8)),
            comm=float(e.get("comm", 0.75)),
            train_mfu=float(e.get("train_mfu", 0.5)),
            prefill_mfu=float(e.get("prefill_mfu", 0.6)),
            allreduce_latency_s=float(e.get("allreduce_latency_us", 30.0)) * 1e-6,
            p2p_latency_s=float(e.get("p2p_latency_us", 10.0)) * 1e-6,
            step_overhead_s=float(e.get("step_overhead_ms", 1.0)) * 1e-3,
            seq_overhead_s=float(e.get("seq_overhead_us", 0.0)) * 1e-6,
        )
        return HardwareProfile(
            id=str(d["id"]),
            name=str(d.get("name", d["id"])),
            memory_bytes=float(d["memory_gib"]) * GIB,
            hbm_bandwidth=float(d["hbm_tbps"]) * 1e12,
            flops=float(d["bf16_tflops"]) * 1e12,
            intra_node_bandwidth=float(d.get("intra_node_gbps", 0.0)) * 1e9,
            intra_node_topology=str(d.get("intra_node_topology", "switch")),
            inter_node_bandwidth=float(d["inter_node_gbps"]) * 1e9,
            devices_per_node=int(d["devices_per_node"]),
            eff=eff,
            sources=sources,
        )
    except KeyError as err:
        raise ConfigError(f"{where or 'hardware profile'}: missing key {err.args[0]!r}") from None
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where or 'hardware profile'}: {err}") from None


def hardware_to_dict(hw: HardwareProfile) -> dict[str, Any]:
    """The data-file layout of a profile (what `hardware_from_dict` reads)."""
    return {
        "id": hw.id,
        "name": hw.name,
        "memory_gib": hw.memory_bytes / GIB,
        "hbm_tbps": hw.hbm_bandwidth / 1e12,
        "bf16_tflops": hw.flops / 1e12,
        "intra_node_gbps": hw.intra_node_bandwidth / 1e9,
        "intra_node_topology": hw.intra_node_topology,
        "inter_node_gbps": hw.inter_node_bandwidth / 1e9,
        "devices_per_node": hw.devices_per_node,
        "efficiency": {
            "hbm": hw.eff.hbm,
            "comm": hw.eff.comm,
            "train_mfu": hw.eff.train_mfu,
            "prefill_mfu": hw.eff.prefill_mfu,
            "allreduce_latency_us": hw.eff.allreduce_latency_s * 1e6,
            "p2p_latency_us": hw.eff.p2p_latency_s * 1e6,
            "step_overhead_ms": hw.eff.step_overhead_s * 1e3,
            "seq_overhead_us": hw.eff.seq_overhead_s * 1e6,
        },
        "sources": dict(hw.sources),
    }


def load_hardware(spec: str) -> HardwareProfile:
    """A built-in id (`a800-80g`) or a path to a profile `.toml`. `local` is not loaded
    here: it needs a measurement (`libra.planner.calibrate.calibrate_local`)."""
    path = Path(spec)
    if spec.endswith(".toml") or path.is_file():
        if not path.is_file():
            raise ConfigError(f"hardware profile file {spec!r} not found")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"hardware profile file {spec!r} cannot be read as UTF-8 text "
                              f"({e}); pass a profile .toml file") from None  # fmt: skip
        return hardware_from_dict(_read_toml(text, spec), spec)
    ref = _data_dir("hardware").joinpath(f"{spec}.toml")
    if spec == "local" or not ref.is_file():
        known = ", ".join(known_hardware())
        if spec == "local":
            raise ConfigError("hardware 'local' must be calibrated: use calibrate_local()")
        raise ConfigError(f"unknown hardware {spec!r}; known: {known} (or a profile .toml file)")
    return hardware_from_dict(_read_toml(ref.read_text(), f"{spec}.toml"), f"{spec}.toml")


def model_from_dict(data: Mapping[str, Any], where: str = "") -> ModelProfile:
    d = dict(data)
    sources = dict(d.pop("sources", {}) or {})
    try:
        return ModelProfile(**d, sources=sources)
    except TypeError as err:
        raise ConfigError(f"{where or 'model profile'}: {err}") from None


def load_model(spec: str) -> ModelProfile:
    """A built-in id (`qwen3-14b`) or a folder with a Hugging Face `config.json`."""
    path = Path(spec)
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.is_file():
            raise ConfigError(f"model folder {spec!r} has no config.json")
        try:
            data = json.loads(cfg.read_text())
        except (ValueError, OSError) as e:  # not JSON, not UTF-8, unreadable
            raise ConfigError(f"{cfg}: not valid JSON: {e}") from None
        return ModelProfile.from_hf_config(data, id=path.name or spec, name=str(path))
    ref = _data_dir("models").joinpath(f"{spec.lower()}.toml")
    if not ref.is_file():
        known = ", ".join(known_models())
        raise ConfigError(f"unknown model {spec!r}; known: {known} (or a folder with config.json)")
    return model_from_dict(_read_toml(ref.read_text(), f"{spec}.toml"), f"{spec}.toml")


__all__ = [
    "GIB",
    "Efficiency",
    "HardwareProfile",
    "ModelProfile",
    "hardware_from_dict",
    "hardware_to_dict",
    "known_hardware",
    "known_models",
    "load_hardware",
    "load_model",
    "model_from_dict",
]
