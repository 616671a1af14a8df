"""Model folders in and out: load an HF causal LM, write one back in the same format.

A written folder is what the embedded engine and vLLM load: `model.safetensors` (float32,
tied embeddings stored once), `config.json` and every tokenizer / template / generation
file copied from the source folder. Folders appear atomically (written beside, renamed).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from libra.errors import ConfigError, ModelError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def check_folder(folder: str | Path) -> Path:
    path = Path(folder).expanduser()
    if not (path / "config.json").is_file():
        raise ModelError(
            f"{path} is not a model folder (no config.json); "
            "make one with `libra make-model DIR` or point trainer.model at an HF folder"
        )
    if not any(path.glob("*.safetensors")):
        raise ModelError(f"{path} has no *.safetensors weights; save the model as safetensors")
    return path


def load_model(folder: str | Path) -> torch.nn.Module:
    """The folder's causal LM in float32 on CPU, in train mode, without a KV cache."""
    from transformers import AutoModelForCausalLM

    path = check_folder(folder)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.config.use_cache = False
    model.train()
    return model


def checkpoint_layers(model: torch.nn.Module) -> None:
    """Recompute each decoder layer in the backward instead of keeping its activations
    (transformers' gradient checkpointing, non-reentrant: it composes with FSDP2)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(
            f"{type(model).__name__} does not support activation checkpointing; set "
            "trainer.activation_checkpointing = false"
        )
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x
    if callable(enable):
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]


def tied_keys(model: torch.nn.Module) -> set[str]:
    """State-dict keys that alias another (stored once in the folder)."""
    if getattr(model.config, "tie_word_embeddings", False):
        return {"lm_head.weight"}
    return set()


def write_folder(
    state: dict[str, torch.Tensor], source: str | Path, out: str | Path, skip: set[str]
) -> Path:
    """Write `state` (full tensors) as an HF folder at `out`, copying the non-weight
    files of `source`; replaces `out` atomically."""
    from safetensors.torch import save_file

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tensors = {
            k: v.detach().to(torch.float32).contiguous().clone()
            for k, v in state.items()
            if k not in skip
        }
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for f in Path(source).iterdir():
            if (
                f.is_file()
                and not f.name.endswith(WEIGHT_SUFFIXES)
                and f.name not in WEIGHT_INDEXES
            ):
                shutil.copy2(f, tmp / f.name)
        swap_in(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def swap_in(tmp: Path, out: Path) -> None:
    """Replace folder `out` with `tmp`, written beside it (a reader sees the old folder
    or the new one, and for a moment none)."""
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


__all__ = ["check_folder", "load_model", "swap_in", "tied_keys", "write_folder"]
