"""What a resumed `libra train` run's engines are brought to: the checkpoint's weights.
The checkpoint is sharded trainer state, not a model folder, so with weights on disk the
run exports it to that version's folder first; a broadcast sends from the trainer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from libra.train import load_config
from libra.train.build import _resumed_weights
from libra.trainer.checkpoint import save
from libra.trainer.config import TrainerConfig
from libra.trainer.model import load_model
from libra.trainer.replica import Replica
from tests.conftest import ROOT
from tests.integration.test_elastic_helpers import micro_model


def test_a_resumed_run_serves_the_checkpoints_weights(tmp_path: Path) -> None:
    source = micro_model(tmp_path / "sft")
    out = tmp_path / "run"
    r = Replica(TrainerConfig(model=str(source), optim={"lr": 0.01}))
    g = torch.randn(r.grad_numel, generator=torch.Generator().manual_seed(0))
    r.apply(g, 10, float(g.square().sum()))
    save(r, out / "checkpoint", {"version": 3})

    cfg = load_config(ROOT / "examples/cpu-train.toml", {"weights.transport": "disk"})
    w = asyncio.run(_resumed_weights(cfg, out, source, 3))
    assert (w.version, w.folder) == (3, str(out / "weights" / "v3"))
    served = load_model(w.folder)
    assert all(torch.equal(a, b) for a, b in
               zip(served.parameters(), r.model.parameters(), strict=True))  # fmt: skip

    cfg = load_config(ROOT / "examples/cpu-train.toml", {"weights.transport": "broadcast"})
    assert asyncio.run(_resumed_weights(cfg, tmp_path / "other", source, 3)).version == 3
    assert not (tmp_path / "other").exists()  # nothing written: the trainer sends them


def test_a_resume_sets_aside_the_episodes_its_checkpoint_does_not_cover(tmp_path: Path) -> None:
    """A run that stopped without a checkpoint at its end recorded groups its last
    checkpoint never trained on; the resume draws them again under the same ids. They
    move to `trajectories-superseded.jsonl`: each id once in `trajectories.jsonl`,
    nothing finished deleted."""
    import orjson

    from libra.train.report import SUPERSEDED, set_aside_groups

    path = tmp_path / "trajectories.jsonl"
    recs = [{"id": f"g{g:06d}/{k}", "group_id": f"g{g:06d}"} for g in range(4) for k in range(2)]
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    assert set_aside_groups(path, 2) == 4
    kept = [orjson.loads(x)["id"] for x in path.read_bytes().splitlines()]
    moved = [orjson.loads(x)["id"] for x in (tmp_path / SUPERSEDED).read_bytes().splitlines()]
    assert kept == ["g000000/0", "g000000/1", "g000001/0", "g000001/1"]
    assert moved == ["g000002/0", "g000002/1", "g000003/0", "g000003/1"]
    assert set_aside_groups(path, 2) == 0  # a second resume at the same point: nothing
