"""Checkpoints: sharded with `torch.distributed.checkpoint` (DCP), loadable at any
replica size; and the HF model folder that inference engines load.

A checkpoint folder (`save`, `load`):

    trainer_state.json    {"version": policy version, "updates": optimizer updates,
                           "adam_step": Adam's step count (behind `updates` by the
                           updates nobody trained on)}
    .metadata             DCP's index: every tensor's global shape and its shards
    __{rank}_0.distcp     one file per rank of the saving replica: its shards of every
                          parameter (`model.NAME`) and of Adam's moments
                          (`optim.NAME.exp_avg`, `optim.NAME.exp_avg_sq`)

Every rank of the saving replica calls `save` and writes only its own shards (no
gather); rank 0 writes the metadata and `trainer_state.json`, then swaps the folder in
atomically (written beside, renamed). `load` reads whatever each rank's shards need from
however many files there are (DCP reshards), so a run saved with 2-rank replicas resumes
with 1-rank replicas and vice versa. The architecture comes from the trainer's
`cfg.model`; only the weights and the optimizer state come from the checkpoint.

A checkpoint is not a model folder: `export_model` turns one into an HF folder in a
single process, and `save_model` writes the live weights as one (gathered from the
shards: what a weight publication and the end of a run write).

The earlier layout (an HF folder with `optimizer.pt`) still loads.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor, distribute_tensor

from libra.errors import ConfigError
from libra.trainer.model import swap_in, tied_keys, write_folder
from libra.trainer.replica import Replica

STATE = "trainer_state.json"
LEGACY = "optimizer.pt"
"""The optimizer file of the earlier, unsharded layout."""
MOMENTS = ("exp_avg", "exp_avg_sq")


def _full(t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return (t.full_tensor() if hasattr(t, "full_tensor") else t.detach()).cpu()


def full_state(replica: Replica) -> dict[str, torch.Tensor]:
    """Every parameter as a whole tensor in host memory (collective for a sharded
    replica; on CPU the one-rank tensors themselves, not copies)."""
    return {name: _full(p) for name, p in replica.model.named_parameters()}


def save_model(replica: Replica, out: str | Path, source: str | Path) -> Path | None:
    """Write the weights as an HF folder at `out` (rank 0 writes; others return None)."""
    state = full_state(replica)
    if replica.rank != 0:
        return None
    return write_folder(state, source, out, tied_keys(replica.model))


def _sharded(replica: Replica) -> dict[str, Any]:
    """What a checkpoint holds, as this rank's (possibly DTensor) tensors, detached: DCP
    writes their local shards and loads into them in place."""
    st = replica.optimizer.state
    params = dict(replica.model.named_parameters())
    return {
        "model": {n: p.detach() for n, p in params.items()},
        "optim": {n: {k: st[p][k].detach() for k in MOMENTS} for n, p in params.items()},
    }


def _single(replica: Replica) -> bool:
    """A 1-rank replica has whole tensors and no process group: DCP runs on its own."""
    return replica.size == 1


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it runs in one process, which a 1-rank replica means to do."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save(replica: Replica, out: str | Path, meta: dict[str, Any]) -> Path | None:
    """Write this rank's shards and, on rank 0, `meta` (version) with the counts; a
    collective over the replica's ranks. Rank 0 returns the folder, others None."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.saving")
    if replica.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save that died half-way
        tmp.mkdir(parents=True)
    if not _single(replica):
        dist.barrier()  # the folder is empty before any rank writes into it
    with _quiet():
        dcp.save(_sharded(replica), checkpoint_id=tmp, no_dist=_single(replica))
    if replica.rank != 0:
        return None  # rank 0's `dcp.save` returns once every rank's shards are written
    doc = {**meta, "updates": replica.updates, "adam_step": replica.adam_step}
    (tmp / STATE).write_text(json.dumps(doc))
    swap_in(tmp, out)
    return out


def read_meta(folder: str | Path) -> dict[str, Any]:
    """`trainer_state.json` of a checkpoint ({} when there is none)."""
    path = Path(folder) / STATE
    if not path.is_file():
        return {}
    out: dict[str, Any] = json.loads(path.read_text())
    return out


def check(folder: str | Path) -> dict[str, Any]:
    """`trainer_state.json` of a checkpoint to resume from; `ConfigError` if `folder`
    is not one."""
    meta = read_meta(folder)
    if not meta:
        raise ConfigError(f"{folder} is not a trainer checkpoint (no {STATE})")
    _kind(Path(folder))
    return meta


def _kind(folder: Path) -> str:
    if (folder / ".metadata").is_file():
        return "dcp"
    if (folder / LEGACY).is_file():
        return "legacy"
    raise ConfigError(
        f"{folder} has {STATE} but no shards (no DCP .metadata, no {LEGACY}): it is not "
        "a whole checkpoint; resume from one ElasticTrainer.save_checkpoint wrote"
    )


def load(replica: Replica, folder: str | Path) -> None:
    """Load a checkpoint into the replica, whatever its size (only this rank's shards
    are read); set the update count and Adam's step. A collective for a sharded replica."""
    folder = Path(folder)
    if _kind(folder) == "legacy":
        _load_legacy(replica, folder)
        return
    with _quiet():
        dcp.load(_sharded(replica), checkpoint_id=folder, no_dist=_single(replica))
    meta = read_meta(folder)
    updates = int(meta["updates"])
    replica.set_counts(updates, float(meta.get("adam_step", updates)))


def _model_weights(folder: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's parameters as whole tensors, read in this process (no group)."""
    if _kind(folder) == "legacy":
        from safetensors.torch import load_file

        return load_file(str(folder / "model.safetensors"))
    md = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    model = {
        key.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
        for key, m in md.items()
        if key.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    with _quiet():
        dcp.load({"model": model}, checkpoint_id=folder, no_dist=True)
    return model


def export_model(folder: str | Path, out: str | Path, source: str | Path) -> Path:
    """Write a checkpoint's weights as an HF folder at `out` (atomically), with the
    config and tokenizer files of `source` (the model the run trains); one process, no
    trainer needed. Tied weights are stored once, as `save_model` does."""
    return write_folder(_model_weights(Path(folder)), source, out, skip=set())


def _into(dst: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a whole tensor into a (possibly DTensor) destination: its shard only."""
    if isinstance(dst, DTensor):
        full = distribute_tensor(full, dst.device_mesh, dst.placements, src_data_rank=None)
        full, dst = full.to_local(), dst.to_local()
    dst.copy_(full)


def _load_legacy(replica: Replica, folder: Path) -> None:
    """The earlier layout: whole tensors in `model.safetensors` and `optimizer.pt`."""
    weights = _model_weights(folder)
    saved = torch.load(folder / LEGACY, map_location="cpu", weights_only=True)
    st = replica.optimizer.state
    with torch.no_grad():
        for name, p in replica.model.named_parameters():
            _into(p, weights[name])
            for k in MOMENTS:
                _into(st[p][k], saved[name][k])
    updates = int(read_meta(folder).get("updates", 0))
    replica.set_counts(updates, float(saved.get("__adam_step__", updates)))


__all__ = ["check", "export_model", "full_state", "load", "read_meta", "save", "save_model"]
