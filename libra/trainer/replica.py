"""One rank of a data-parallel replica: model, AdamW, and the flat layouts the elastic
layer moves (gradients out, averaged gradients in, state snapshots both ways).

A replica of several ranks is sharded with FSDP2 `fully_shard` over its own process
group (the process's default group, built once and never rebuilt). Every tensor here
is the rank's *local shard*; shard j of every replica has the same layout, so the
cross-replica domain all-reduces shard j with shard j.

`apply` is the one place an optimizer update happens, for live steps and for a
joiner's replay alike, so a replayed update is bit-identical to the live one.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

from libra.trainer.config import TrainerConfig
from libra.trainer.device import Device, parallelize, replica_mesh
from libra.trainer.model import checkpoint_layers, load_model


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor behind a (possibly DTensor) parameter or state, aliasing it."""
    with torch.no_grad():
        return t.to_local() if hasattr(t, "to_local") else t


class Replica:
    """Model + optimizer of one rank. `rank`/`size` are inside the replica; `device`
    defaults to what `cfg` resolves to."""

    def __init__(
        self, cfg: TrainerConfig, *, rank: int = 0, size: int = 1, model_dir=None,
        device: Device | None = None,
    ):  # fmt: skip
        self.cfg = cfg
        self.device = device or Device.resolve(cfg)
        self.rank, self.size = rank, size
        dev = self.device.torch
        self.model = load_model(model_dir or cfg.model).to(dev)
        if cfg.activation_checkpointing:
            checkpoint_layers(self.model)
        if size > 1:
            parallelize(self.model, replica_mesh(self.device, size), cfg)
        self.ref_model = None
        if cfg.grpo.kl_coef > 0:
            self.ref_model = load_model(cfg.model).to(dev).eval().requires_grad_(False)
        o = cfg.optim
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # Fused AdamW (one pass over memory, ~3x faster on CPU) for plain tensors; the
        # per-tensor loop for FSDP's DTensors. Every replica has the same size, so all
        # run the same implementation: updates stay bit-identical across replicas.
        kind = {"fused": True} if size == 1 else {"foreach": False}
        self.optimizer = torch.optim.AdamW(
            self.params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, **kind
        )
        # Explicit state and persistent gradients: a joiner that never ran backward has
        # the same tensors to receive a snapshot into, and backward accumulates in place.
        for p in self.params:
            self.optimizer.state[p] = {
                # on the parameter's device: the fused CUDA kernel reads it there
                "step": torch.tensor(0.0, device=dev if size == 1 else "cpu"),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }
            p.grad = torch.zeros_like(p)
        self.numels = [_local(p).numel() for p in self.params]
        self.grad_numel = sum(self.numels)
        self.updates = 0
        """Optimizer updates applied to this state."""

    # -- layouts ----------------------------------------------------------------------

    def state_tensors(self) -> list[torch.Tensor]:
        """The snapshot layout: parameters, then exp_avg, then exp_avg_sq (local shards)."""
        st = self.optimizer.state
        return (
            [_local(p) for p in self.params]
            + [_local(st[p]["exp_avg"]) for p in self.params]
            + [_local(st[p]["exp_avg_sq"]) for p in self.params]
        )

    @property
    def state_numel(self) -> int:
        return 3 * self.grad_numel

    @property
    def adam_step(self) -> float:
        """Adam's own step count (behind `updates` by the no-op updates)."""
        return float(self.optimizer.state[self.params[0]]["step"])

    def set_counts(self, updates: int, adam_step: float) -> None:
        """Set the update count and Adam's step (bias correction) from a snapshot."""
        self.updates = updates
        for p in self.params:
            self.optimizer.state[p]["step"].fill_(adam_step)

    def state_hash(self) -> str:
        """blake2b of parameters + Adam state (moments, step) + update count of this
        rank's shard."""
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{self.updates}/{self.adam_step}".encode())
        for t in self.state_tensors():
            h.update(memoryview(t.detach().cpu().contiguous().view(torch.uint8).numpy()))  # type: ignore[arg-type]
        return h.hexdigest()

    def _grads(self) -> Iterator[tuple[torch.Tensor, int, int]]:
        off = 0
        for p, n in zip(self.params, self.numels, strict=True):
            assert p.grad is not None
            yield _local(p.grad), off, n
            off += n

    # -- gradients --------------------------------------------------------------------

    def pack_grads(self, flat: torch.Tensor) -> None:
        """Copy the local gradient shards into `flat[:grad_numel]`."""
        for g, off, n in self._grads():
            flat[off : off + n].copy_(g.reshape(-1))

    def zero_grads(self) -> None:
        for g, _, _ in self._grads():
            g.zero_()

    def lr_at(self, update: int) -> float:
        o = self.cfg.optim
        if o.warmup_updates and update < o.warmup_updates:
            return o.lr * update / o.warmup_updates
        return o.lr

    def apply(self, flat: torch.Tensor, tokens: float, sumsq: float) -> float:
        """One update from a summed gradient: divide by the global token count, clip by
        the global norm (from `sumsq`, the replica-wide sum of squares of the summed
        gradient), AdamW. Returns the pre-clip norm of the averaged gradient.

        A gradient with a NaN or an infinity in it (its norm is not finite) is not
        applied: the update is skipped as an empty one is (counted, no Adam step), so one
        overflow does not leave NaN in every weight. Every replica computes the same
        `sumsq`, so all skip alike; the caller sees the norm and reports the skip."""
        self.updates += 1
        if tokens <= 0:  # nobody trained: a no-op update on every replica alike
            self.zero_grads()
            return 0.0
        scale = 1.0 / tokens
        norm = math.sqrt(sumsq) * scale
        if not math.isfinite(norm):
            self.zero_grads()
            return norm
        mult = scale
        limit = self.cfg.optim.max_grad_norm
        if limit is not None and norm > limit:
            mult = scale * limit / (norm + 1e-6)
        with torch.no_grad():
            for g, off, n in self._grads():
                # `flat` is the elastic domain's host buffer; a CUDA shard copies it in
                # first (the same float32 product, so replicas stay bit-identical).
                src = flat[off : off + n].view_as(g)
                if src.device != g.device:
                    g.copy_(src)
                    src = g
                torch.mul(src, mult, out=g)
        lr = self.lr_at(self.updates)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.zero_grads()
        return norm

    # -- replica-internal collectives -------------------------------------------------

    def intra_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum a small float64 vector over the replica's ranks (identity for one rank)."""
        if self.size > 1:
            t = values.to(self.device.comm)
            dist.all_reduce(t)
            return t.cpu()
        return values

    def intra_max(self, value: int) -> int:
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device.comm)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())


def sumsq(flat: torch.Tensor, chunk: int = 1 << 16) -> float:
    """Sum of squares of a gradient vector: float32 dot products over fixed chunks,
    accumulated in float64. A fixed order on one thread, so every replica computes the
    same bits from the same vector."""
    total = 0.0
    for i in range(0, flat.numel(), chunk):
        c = flat[i : i + chunk]
        total += float(torch.dot(c, c))
    return total


__all__ = ["Replica", "sumsq"]
