"""A 2-rank FSDP2 replica under the bfloat16 mixed-precision policy (gloo on CPU):
parameters are all-gathered and computed in bfloat16, gradients reduce-scattered in
float32 into float32 shards. Its gradients match the float32 replica's within the
tolerance the unsharded autocast path is held to (5% relative norm), and the compute
really ran in bfloat16 (the layers saw bfloat16 weights; the gradients differ)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

from tests.conftest import ROOT, free_port


def _rank(rank: int, folder: str, port: int, out: str) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    from libra.trainer import grpo
    from libra.trainer.config import GRPOConfig, TrainerConfig
    from libra.trainer.device import CPU, parallelize, replica_mesh
    from libra.trainer.model import load_model
    from tests.unit.test_grpo import samples

    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        batch = samples(6, 3)[rank::2]
        result: dict[str, object] = {}
        for dtype in ("float32", "bfloat16"):
            torch.manual_seed(0)
            model = load_model(folder)
            parallelize(model, replica_mesh(CPU, 2), TrainerConfig(model=folder, dtype=dtype))
            seen: set[torch.dtype] = set()

            def record(m: torch.nn.Module, args: object, seen: set = seen) -> None:
                seen.add(m.weight.dtype)  # type: ignore[arg-type]

            hooks = [m.register_forward_pre_hook(record)
                     for m in model.modules() if isinstance(m, torch.nn.Linear)]  # fmt: skip
            cfg = GRPOConfig(micro_batch_tokens=10_000, logprob_chunk_tokens=7)
            grpo.backward(model, batch, cfg, dtype=dtype)
            for h in hooks:
                h.remove()
            shards = {p.grad.to_local().dtype for p in model.parameters()}  # type: ignore[union-attr]
            full = [p.grad.full_tensor().reshape(-1) for p in model.parameters()]  # type: ignore[union-attr]
            local = {p.to_local().dtype for p in model.parameters()}  # type: ignore[operator]
            result[dtype] = (torch.cat(full), seen, shards | local)
        if rank == 0:
            torch.save(result, out)
        dist.barrier()  # no rank tears its group down while a peer's last op is in flight
    finally:
        dist.destroy_process_group()


def test_bf16_policy_replica_matches_float32_within_tolerance(tmp_path: Path) -> None:
    from tests.integration.test_elastic_helpers import micro_model

    folder = micro_model(tmp_path / "m")
    out = tmp_path / "grads.pt"
    mp.spawn(_rank, args=(str(folder), free_port(), str(out)), nprocs=2)
    res = torch.load(out)
    g32, seen32, stored32 = res["float32"]
    g16, seen16, stored16 = res["bfloat16"]
    assert seen32 == {torch.float32} and seen16 == {torch.bfloat16}  # computed in bf16
    assert stored32 == stored16 == {torch.float32}  # shards, gradients: float32
    assert torch.isfinite(g16).all() and not torch.equal(g16, g32)
    assert g32.norm() > 0 and (g16 - g32).norm() / g32.norm() < 0.05
