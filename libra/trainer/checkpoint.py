"""Checkpoints: an HF model folder plus the optimizer, loadable at any replica size.

A checkpoint folder is a complete model folder (what `libra serve-engine` and vLLM
load) with two more files:

    optimizer.pt          {parameter name: {"exp_avg": full tensor, "exp_avg_sq": ...},
                           "__adam_step__": Adam's step count}
    trainer_state.json    {"version": policy version, "updates": optimizer updates}

Tensors are stored whole (gathered from FSDP shards), so a run saved with 2-rank
replicas resumes with 1-rank replicas and vice versa. Gathering is a collective over
the replica's own group: every rank of the saving replica calls `save`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from libra.trainer.model import tied_keys, write_folder
from libra.trainer.replica import Replica


def _full(t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def full_state(replica: Replica) -> dict[str, torch.Tensor]:
    """Every parameter as a whole tensor (collective for a sharded replica)."""
    return {name: _full(p) for name, p in replica.model.named_parameters()}


def save_model(replica: Replica, out: str | Path, source: str | Path) -> Path | None:
    """Write the weights as an HF folder at `out` (rank 0 writes; others return None)."""
    state = full_state(replica)
    if replica.rank != 0:
        return None
    return write_folder(state, source, out, tied_keys(replica.model))


def save(
    replica: Replica, out: str | Path, source: str | Path, meta: dict[str, Any]
) -> Path | None:
    """Model folder + optimizer + `meta` (version, updates); rank 0 writes."""
    st = replica.optimizer.state
    opt: dict[str, Any] = {
        name: {k: _full(st[p][k]).clone() for k in ("exp_avg", "exp_avg_sq")}
        for name, p in replica.model.named_parameters()
    }
    opt["__adam_step__"] = replica.adam_step
    path = save_model(replica, out, source)
    if path is None:
        return None
    torch.save(opt, path / "optimizer.pt")
    (path / "trainer_state.json").write_text(json.dumps({**meta, "updates": replica.updates}))
    return path


def read_meta(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "trainer_state.json"
    if not path.is_file():
        return {}
    out: dict[str, Any] = json.loads(path.read_text())
    return out


def load_optimizer(replica: Replica, folder: str | Path) -> None:
    """Load `optimizer.pt` into the (possibly sharded) replica; set the update count."""
    path = Path(folder) / "optimizer.pt"
    if not path.is_file():
        return
    saved = torch.load(path, map_location="cpu", weights_only=True)
    st = replica.optimizer.state
    with torch.no_grad():
        for name, p in replica.model.named_parameters():
            for k in ("exp_avg", "exp_avg_sq"):
                full = saved[name][k]
                dst = st[p][k]
                if hasattr(dst, "device_mesh"):
                    from torch.distributed.tensor import distribute_tensor

                    full = distribute_tensor(
                        full, dst.device_mesh, dst.placements, src_data_rank=None
                    ).to_local()
                    dst = dst.to_local()
                dst.copy_(full)
    updates = int(read_meta(folder).get("updates", 0))
    replica.set_counts(updates, float(saved.get("__adam_step__", updates)))


__all__ = ["full_state", "load_optimizer", "read_meta", "save", "save_model"]
