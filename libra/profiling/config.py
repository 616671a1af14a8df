"""What `libra profile` measures: the endpoints, the grid, the trainer micro-step."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from libra.config import Config


class EndpointSpec(Config):
    bucket: str
    url: str
    tp: int = Field(1, ge=1)
    """Tensor-parallel size of the instance behind the URL (from `--bucket NAME=TP:BOUND`
    or a bucket named `tpN`)."""


class ProfileConfig(Config):
    """One profiling run (the flags of `libra profile`)."""

    endpoints: list[EndpointSpec] = Field(min_length=1)
    """The endpoints to time, one after another (they should serve one model on one kind
    of hardware: the result is one hardware profile)."""
    kind: Literal["auto", "embedded", "vllm"] = "auto"
    """What serves the endpoints; `auto` reads `owned_by` of `/v1/models`."""
    model: str | None = None
    """The served model: a folder with config.json or a known profile id. Default: the
    folder the endpoints report (`root` of `/v1/models`), when it exists here."""
    base: str = "local"
    """The profile whose unmeasured figures (memory, links, devices per node, the peaks
    the efficiencies are fractions of) the result keeps: a built-in id, a profile .toml,
    or `local` (this machine, calibrated now)."""
    devices: int | None = Field(None, ge=1)
    """`base = "local"`: devices this machine counts as (default: its cores)."""
    batches: list[int] = Field(default_factory=lambda: [1, 4, 16], min_length=2)
    """Decode batch sizes of the grid (sequences per step)."""
    contexts: list[int] = Field(default_factory=lambda: [128, 512, 2048], min_length=2)
    """Prompt lengths of the grid (tokens per sequence)."""
    decode_tokens: int = Field(32, ge=4)
    """N: tokens generated per sequence in the long request of a decode pair."""
    repeats: int = Field(10, ge=1)
    """Rounds over the grid: timed requests per point (their first quartile is kept)."""
    held_out: tuple[int, int] | None = None
    """(batch, context) measured but not fitted, to check the prediction. Default: the
    geometric midpoints of the two largest grid values (off the grid)."""
    train_step: bool = True
    """Time a trainer micro-step when the model folder (with weights) is on this machine."""
    train_lengths: list[int] = Field(default_factory=lambda: [256, 1024], min_length=1)
    """Sequence lengths of the micro-step's grid; the held-out length is the geometric
    midpoint of the last two (with one length, nothing is held out)."""
    train_sequences: int = Field(2, ge=1)
    """Sequences per micro-step."""
    id: str | None = None
    """Profile id (default: `<base id>-profiled`)."""
    seed: int = 0
    """Seeds the random prompts."""

    @model_validator(mode="after")
    def _grid(self) -> ProfileConfig:
        for name in ("batches", "contexts", "train_lengths"):
            values = getattr(self, name)
            if any(v < 1 for v in values) or len(set(values)) != len(values):
                raise ValueError(f"{name} must be distinct positive integers (got {values})")
        _ = self.held_out_point, self.train_held_out  # a grid with no room for them fails here
        return self

    @property
    def held_out_point(self) -> tuple[int, int]:
        if self.held_out is not None:
            b, c = self.held_out
            if b in self.batches and c in self.contexts:
                raise ValueError(f"held_out {b}:{c} is a grid point; pick one off the grid")
            return b, c
        return midpoint(self.batches, "batch"), midpoint(self.contexts, "context")

    @property
    def train_held_out(self) -> int | None:
        if len(self.train_lengths) < 2:
            return None
        return midpoint(self.train_lengths, "train length")

    @property
    def longest(self) -> int:
        """The longest sequence a request of the grid reaches."""
        return max(*self.contexts, self.held_out_point[1]) + self.decode_tokens


def midpoint(values: list[int], what: str) -> int:
    """A value between the two largest of `values` and not among them (geometric mean,
    else arithmetic)."""
    a, b = sorted(values)[-2:]
    for v in (round(math.sqrt(a * b)), (a + b) // 2):
        if v not in values:
            return v
    raise ValueError(
        f"no {what} lies between {a} and {b}; widen the grid or name the held-out point"
    )


__all__ = ["EndpointSpec", "ProfileConfig", "midpoint"]
