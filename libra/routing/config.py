"""`RoutingConfig`: the options of the routing policies (the `[rollout.routing]` table).

One config serves every policy; a policy ignores the fields that are not its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationError, model_validator

from libra.config import Config


class RoutingConfig(Config):
    small_payload: int = Field(500, ge=0)
    """A tool response of at most this many tokens is `small` (reference code default)."""
    large_payload: int = Field(5_000, ge=0)
    """Above this many tokens it is `large`; in between, `medium`."""
    min_samples: int = Field(8, ge=1)
    """Episodes a tree node needs before C-MLFQ trusts its statistics (fewer: the
    search falls back to a shallower node or to the pooled tree)."""
    window: int = Field(256, ge=1)
    """Episodes per tumbling window of a node's histograms; a node's statistics cover
    its last one to two windows."""
    max_nodes: int = Field(200_000, ge=1)
    """Node cap of the tree; beyond it the least recently updated prompts are evicted."""
    max_depth: int = Field(64, ge=1)
    """Tool returns per path the tree keeps; deeper states share the deepest node."""
    tree_path: Path | None = None
    """File the C-MLFQ tree is loaded from at start (when it exists) and saved to by
    `policy.save()`, so what was learned carries across runs."""
    update: Literal["between-steps", "online"] = "between-steps"
    """`between-steps` (the paper): finished episodes update the tree when the engine
    calls `policy.end_step()`; `online`: each one as it finishes."""
    start: Literal["tree", "smallest"] = "tree"
    """Where C-MLFQ starts an episode. `smallest` (the paper): the smallest bucket that
    fits the prompt. `tree`: the same, unless the prompt's root node (or the pooled
    root) puts both its mean and its P90 total in another bucket."""
    deadline: bool = True
    """When the predictions disagree but the episode's next turn will likely outgrow
    its bucket (and it most likely ends beyond it), move now to the most probable
    larger bucket instead of waiting for an overflow (docs/cmlfq.md)."""
    kv_aware: bool = True
    """C-MLFQ moves only when the move pays for its re-prefill (see docs/cmlfq.md)."""
    rule: Literal["paper", "distribution"] | None = None
    """How C-MLFQ picks a bucket from a tree node. `paper`: the bucket where the node's
    mean and P90 predictions agree (with `deadline`). `distribution`: the bucket the
    node's whole length distribution makes most probable as the episode's final one
    (P(final bucket | node, current length)). Default: `distribution` when `objective`
    is set, else `paper`."""
    objective: Literal["accuracy", "cost"] | None = None
    """What C-MLFQ's moves serve. `accuracy`: the `distribution` rule for single-shot
    accuracy, which counts an episode moved at most once: one move per episode, made
    when it beats waiting for the next tool return (a one-step lookahead through the
    node's children), `kv_aware` ignored. `cost`: the `distribution` rule, a move only
    when the KV-aware judge finds it pays for its re-prefill (`kv_aware` forced). None
    (default): the paper's rule with `kv_aware` and `deadline` as set."""
    backoff: Literal["deepest", "blend"] = "deepest"
    """`distribution` rule: which node speaks for an episode. `deepest`: the deepest node
    with `min_samples` episodes, the prompt's or the pooled one. `blend`: both, the
    prompt's probabilities weighted n / (n + min_samples) by its n episodes."""
    gate: bool = False
    """`distribution` rule only: also require the paper's mean/P90 agreement on the
    target (a confidence gate: fewer, surer moves)."""
    cost_profile: str | None = None
    """`MODEL@HARDWARE` planner profiles (e.g. `qwen3-14b@a800-80g`) that price KV-aware
    moves with the planner's rollout cost model; default: the built-in TP-scaled
    roofline (`libra.routing.cost.TPScaledCost`)."""
    decode_batch: int = Field(32, ge=1)
    """Concurrent sequences assumed on an instance when the cost model prices a decode
    step (KV-aware moves)."""
    history: int = Field(20_000, ge=16)
    """Finished episodes the length predictor fits on (most recent)."""

    @property
    def decision_rule(self) -> Literal["paper", "distribution"]:
        """The rule in force (`rule`, else per `objective`)."""
        if self.rule is not None:
            return self.rule
        return "paper" if self.objective is None else "distribution"

    @property
    def judges_cost(self) -> bool:
        """Whether moves go through the KV-aware cost judge."""
        return self.kv_aware if self.objective is None else self.objective == "cost"

    @model_validator(mode="after")
    def _thresholds(self) -> RoutingConfig:
        if self.large_payload < self.small_payload:
            raise ValueError(
                f"large_payload ({self.large_payload}) must be >= small_payload "
                f"({self.small_payload})"
            )
        return self


PolicyName = Literal["cmlfq", "mlfq", "predictor", "static"]
"""The routing policies a config may name (`libra.routing.make_policy`)."""


def routing_table(table: dict[str, Any]) -> dict[str, Any]:
    """A pydantic after-validator for a config's `routing` table: its keys and values
    are `RoutingConfig`'s (checked when the config loads, not when a run has started)."""
    try:
        RoutingConfig.model_validate(table)
    except ValidationError as e:
        from libra.config import format_validation_error

        raise ValueError(format_validation_error(e, "routing")) from None
    return table


RoutingTable = Annotated[dict[str, Any], AfterValidator(routing_table)]
"""A `routing` table validated as `RoutingConfig` (kept as the table the user wrote)."""


__all__ = ["PolicyName", "RoutingConfig", "RoutingTable", "routing_table"]
