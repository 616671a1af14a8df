"""Chunked log-probs under a 2-rank FSDP2 replica (gloo on CPU): the output head runs
outside the root module's forward, on the weight the root left unsharded, so its
gradient must still reach the reduce-scatter. The full gradients of the chunked pass
equal those of the whole-logits pass (tied embeddings: the head's weight is the
embedding's), and so do those of a packed pass (`grpo.packing`: each rank's samples in
one row)."""

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
    from torch.distributed.device_mesh import init_device_mesh

    from libra.trainer import grpo
    from libra.trainer.config import GRPOConfig, TrainerConfig
    from libra.trainer.device import parallelize
    from libra.trainer.model import load_model
    from tests.unit.test_grpo import samples

    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = load_model(folder)
        parallelize(model, init_device_mesh("cpu", (2,)), TrainerConfig(model=folder))
        batch = samples(6, 3)[rank::2]
        grads = {}
        for chunk, packing in ((0, False), (7, False), (7, True)):
            model.zero_grad(set_to_none=False)
            cfg = GRPOConfig(micro_batch_tokens=10_000, logprob_chunk_tokens=chunk,
                             packing=packing)  # fmt: skip
            grpo.backward(model, batch, cfg)
            grads[chunk, packing] = torch.cat([p.grad.full_tensor().reshape(-1)  # type: ignore[union-attr]
                                      for p in model.parameters()])  # fmt: skip
        if rank == 0:
            torch.save(grads, out)
        dist.barrier()  # no rank tears its group down while a peer's last op is in flight
    finally:
        dist.destroy_process_group()


def test_chunked_logprobs_give_the_same_gradients_under_fsdp(tmp_path: Path) -> None:
    from tests.integration.test_elastic_helpers import micro_model

    folder = micro_model(tmp_path / "m")
    out = tmp_path / "grads.pt"
    mp.spawn(_rank, args=(str(folder), free_port(), str(out)), nprocs=2)
    grads = torch.load(out)
    whole, chunked, packed = grads[0, False], grads[7, False], grads[7, True]
    assert whole.norm() > 0
    assert (chunked - whole).norm() / whole.norm() < 1e-5
    assert (packed - whole).norm() / whole.norm() < 1e-5
