"""Samples -> micro-batches: which samples share a forward pass, and their tensors.

Two layouts of the same per-token quantities (`GRPOConfig.packing`):

- **padded** (`collate`): one sample per row, right-padded to the longest; at most
  `micro_batch_tokens` *padded* tokens (rows x longest) per micro-batch, samples sorted
  by length so the padding stays small.
- **packed** (`pack`): the samples concatenated in one row `[1, total]`, `position_ids`
  restarting at 0 at each sample and no attention mask. transformers then finds the
  samples from the position ids (`masking_utils.find_packed_sequence_indices`: a new
  sample wherever the position does not grow by 1) and masks attention block-diagonally
  (`create_causal_mask`), so each sample sees only its own tokens, as in its padded row.
  At most `micro_batch_tokens` tokens (the sum of lengths) per micro-batch, planned
  first-fit decreasing; no padding.

Either way position t of a row predicts token t + 1, and `mask`, `rollout` and
`advantage` are laid out per position: the loss, a sum over loss tokens, is the same
in both. In a packed row the last position of a sample predicts the first token of the
next one: it carries no loss (mask 0, rollout nan).

A sample longer than the budget gets a micro-batch of its own in both layouts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from libra.trainer.samples import Sample


@dataclass(slots=True)
class MicroBatch:
    """Tensors for one forward pass; position t of a row predicts token t + 1."""

    input_ids: torch.Tensor  # [R, T] long
    attention_mask: torch.Tensor | None  # [R, T] long (padded); None (packed)
    mask: torch.Tensor  # [R, T-1] float: 1 where token t+1 carries loss
    rollout: torch.Tensor  # [R, T-1] float: rollout log-prob of token t+1 (or nan)
    advantage: torch.Tensor  # broadcasts to [R, T-1]: the advantage of position t's sample
    lengths: list[int]
    prompt_lens: list[int]
    position_ids: torch.Tensor | None = None  # [1, T] long, restarting at 0 (packed)
    offsets: list[int] | None = None
    """Packed: where each sample starts in the one row; None: sample k is row k."""

    def spans(self) -> list[tuple[int, int, int]]:
        """(row, first position, positions) of each sample's [length - 1] predictions."""
        if self.offsets is None:
            return [(k, 0, n - 1) for k, n in enumerate(self.lengths)]
        return [(0, o, n - 1) for o, n in zip(self.offsets, self.lengths, strict=True)]

    def to(self, device: torch.device) -> MicroBatch:
        """The same micro-batch with its tensors on `device` (itself on the CPU)."""
        if device.type == "cpu":
            return self

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return MicroBatch(
            self.input_ids.to(device, non_blocking=True), move(self.attention_mask),
            self.mask.to(device, non_blocking=True), self.rollout.to(device, non_blocking=True),
            self.advantage.to(device, non_blocking=True), self.lengths, self.prompt_lens,
            move(self.position_ids), self.offsets,
        )  # fmt: skip

    def per_sample(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each sample's [length - 1] slice of a per-position tensor [R, T-1]."""
        return [x[r, o : o + n] for r, o, n in self.spans()]

    def place(self, values: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-sample [length - 1] tensors laid out as [R, T-1] (zeros elsewhere)."""
        out = torch.zeros_like(self.mask)
        for (r, o, n), v in zip(self.spans(), values, strict=True):
            out[r, o : o + n] = v
        return out


def collate(samples: Sequence[Sample]) -> MicroBatch:
    """One sample per row, right-padded to the longest."""
    t = max(s.length for s in samples)
    mb = _layout(samples, rows=len(samples), width=t, places=[(i, 0) for i in range(len(samples))])
    mb.attention_mask = torch.zeros(len(samples), t, dtype=torch.long)
    for i, s in enumerate(samples):
        mb.attention_mask[i, : s.length] = 1
    return mb


def pack(samples: Sequence[Sample]) -> MicroBatch:
    """All samples in one row, position ids restarting at 0 at each (no attention mask)."""
    offsets = [0]
    for s in samples[:-1]:
        offsets.append(offsets[-1] + s.length)
    total = offsets[-1] + samples[-1].length
    mb = _layout(samples, rows=1, width=total, places=[(0, o) for o in offsets])
    mb.position_ids = torch.cat([torch.arange(s.length) for s in samples]).unsqueeze(0)
    mb.offsets = offsets
    return mb


def _layout(
    samples: Sequence[Sample], *, rows: int, width: int, places: list[tuple[int, int]]
) -> MicroBatch:
    """Sample k's tokens at row r, positions o.. for (r, o) = places[k]; every other
    position carries no loss."""
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width - 1)
    rollout = torch.full((rows, width - 1), float("nan"))
    adv = torch.zeros(rows, width - 1)
    for s, (r, o) in zip(samples, places, strict=True):
        n, p = s.length, s.prompt_len
        ids[r, o : o + n] = torch.tensor(s.input_ids)
        # response token j sits at position p + j and is predicted at p + j - 1
        mask[r, o + p - 1 : o + n - 1] = torch.tensor(s.loss_mask, dtype=torch.float32)
        if s.rollout_logprobs:
            rollout[r, o + p - 1 : o + n - 1] = torch.tensor(
                s.rollout_logprobs, dtype=torch.float32
            )
        adv[r, o : o + n - 1] = s.advantage
    return MicroBatch(ids, None, mask, rollout, adv, [s.length for s in samples],
                      [s.prompt_len for s in samples])  # fmt: skip


def plan_micro_batches(
    samples: Sequence[Sample], budget: int, *, packing: bool = False
) -> list[list[int]]:
    """Indices of samples per micro-batch, each at most `budget` tokens: padded (rows x
    longest) or, `packing`, the sum of lengths. A longer sample gets one of its own."""
    return _plan_packed(samples, budget) if packing else _plan_padded(samples, budget)


def _plan_padded(samples: Sequence[Sample], budget: int) -> list[list[int]]:
    """Sorted by length, so padding stays small."""
    order = sorted(range(len(samples)), key=lambda i: samples[i].length)
    plans: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        longest = samples[i].length  # ascending order: the newest is the longest
        if cur and longest * (len(cur) + 1) > budget:
            plans.append(cur)
            cur = []
        cur.append(i)
    if cur:
        plans.append(cur)
    return plans


def _plan_packed(samples: Sequence[Sample], budget: int) -> list[list[int]]:
    """First-fit decreasing: each sample, longest first, joins the first micro-batch
    it fits in (few passes: at most 11/9 of the fewest plus one)."""
    order = sorted(range(len(samples)), key=lambda i: -samples[i].length)
    plans: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = samples[i].length
        for k, left in enumerate(room):
            if n <= left:
                plans[k].append(i)
                room[k] -= n
                break
        else:
            plans.append([i])
            room.append(budget - n)
    return plans


def micro_batches(
    samples: Sequence[Sample], budget: int, *, packing: bool = False, count: int | None = None
) -> Iterator[tuple[list[int], MicroBatch | None]]:
    """The micro-batches of `samples`, followed by `None` entries up to `count` (FSDP
    ranks of one replica must run the same number of passes)."""
    plans = plan_micro_batches(samples, budget, packing=packing)
    make = pack if packing else collate
    for idx in plans:
        yield idx, make([samples[i] for i in idx])
    for _ in range(max(0, (count or 0) - len(plans))):
        yield [], None


__all__ = ["MicroBatch", "collate", "micro_batches", "pack", "plan_micro_batches"]
