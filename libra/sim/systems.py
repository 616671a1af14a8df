"""The systems the simulator compares (defined precisely in docs/baselines.md).

A system is a choice on each axis of resource management, nothing else: every system
runs the same workload, the same instances and trainer models, and (except
verl-Colocated, which is synchronous) the same asynchronous pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from libra.errors import ConfigError

OracleStart = Literal["episode", "prompt"]
"""What the diagnostic oracle knows before an episode's first turn (`SystemSpec`)."""


@dataclass(frozen=True, slots=True)
class SystemSpec:
    name: str
    summary: str
    split: Literal[
        "colocated", "colocated-searched", "even", "searched", "planner", "greedy", "ceiling"
    ]
    """How GPUs are divided between training and rollout: `searched`, `colocated-searched`
    and `ceiling` are the fastest static layouts pilot runs find (`libra.sim.search`)."""
    hetero: bool = False
    """Rollout instances of several TP sizes (the planner's mix) instead of one."""
    routing: str = "static"
    """`static` (one bucket per TP size, the smallest that fits), `pooled` (one bucket
    of every instance, least-loaded per GPU: no length-aware routing), or a
    `libra.routing.make_policy` name routing over the plan's buckets (`mlfq`, `cmlfq`),
    or `oracle` (a diagnostic upper bound, not a policy: every episode starts in the
    bucket of its true final length and never moves; see `oracle_from`)."""
    oracle_from: int = 0
    """With `oracle` routing, the tool return from which the oracle routes: 0, from the
    start; k > 0, each episode is placed as `static` places it (the smallest bucket that
    fits, spilling to a less loaded larger one) until its k-th tool return; from then
    on the router's answer at every return is the bucket of its true final length,
    which the fleet applies as any policy's answer (a floor: an episode below it moves
    up to it). What a router could gain that knew every length exactly as soon as the
    episode had run k turns, and no sooner."""
    oracle_start: OracleStart = "episode"
    """With `oracle` routing, what the oracle knows before an episode's first turn:
    `episode`, its own final length; `prompt`, only its prompt's typical final length
    (the geometric mean over the batch's samples of that prompt: what a perfect
    predictor of a prompt's difficulty could know, never an episode's own luck). With
    `prompt` an episode starts in that length's bucket as a policy's start answer (a
    floor: it may spill to a less loaded larger bucket); from tool return `oracle_from`
    on (if > 0) it is routed by its own true length."""
    replan: bool = False
    """Replan from fresh trajectories (`ReplanPolicy`) during the run."""
    elastic: bool = False
    """Elastic hybrid pool: idle rollout instances join training as data-parallel
    replicas, and data-parallel changes need no restart."""
    rollout_tp: int | None = None
    """Every rollout instance at this TP size (the `@tpN` variants: a baseline as the
    paper's reference code ran it) instead of the size the cost model finds fastest."""

    @property
    def sync(self) -> bool:
        return self.split in ("colocated", "colocated-searched")


SYSTEMS: dict[str, SystemSpec] = {
    s.name: s
    for s in (
        SystemSpec(
            "verl-colocated",
            "all GPUs alternate rollout and training (synchronous), uniform TP",
            split="colocated",
        ),
        SystemSpec(
            "verl-static-uniform",
            "fixed even split, uniform TP, no migration (one step off-policy)",
            split="even",
        ),
        SystemSpec(
            "verl-greedy-heuristic",
            "shifts a node toward the previous step's bottleneck, uniform TP",
            split="greedy",
        ),
        SystemSpec(
            "areal-static-optimal",
            "the fastest static split and uniform TP in pilot runs of the first steps, fixed",
            split="searched",
        ),
        SystemSpec(
            "best-static-colocated",
            "colocated (synchronous), the rollout TP size fastest in pilot runs, fixed",
            split="colocated-searched",
        ),
        SystemSpec(
            "libra-homogeneous",
            "ladder 1: the planner with replanning, uniform TP",
            split="planner",
            replan=True,
        ),
        SystemSpec(
            "libra-hetero-tp",
            "ladder 2: + heterogeneous TP (no length-aware routing yet)",
            split="planner",
            hetero=True,
            routing="pooled",
            replan=True,
        ),
        SystemSpec(
            "libra-cmlfq",
            "ladder 3: + C-MLFQ routing",
            split="planner",
            hetero=True,
            routing="cmlfq",
            replan=True,
        ),
        SystemSpec(
            "libra",
            "ladder 4: + elastic hybrid pool (= Libra)",
            split="planner",
            hetero=True,
            routing="cmlfq",
            replan=True,
            elastic=True,
        ),
        SystemSpec(
            "ceiling",
            "reference: the fastest static layout (any TP mix) in pilot runs with oracle "
            "routing, fixed",
            split="ceiling",
            hetero=True,
            routing="oracle",
        ),
        SystemSpec(
            "libra-oracle-routing",
            "diagnostic: Libra with routing that knows every episode's final length",
            split="planner",
            hetero=True,
            routing="oracle",
            replan=True,
            elastic=True,
        ),
        SystemSpec(
            "libra-oracle-prompt-start",
            "diagnostic: Libra with routing that knows each prompt's typical final length "
            "before the first turn, and every episode's own from its first tool return on",
            split="planner",
            hetero=True,
            routing="oracle",
            replan=True,
            elastic=True,
            oracle_from=1,
            oracle_start="prompt",
        ),
        SystemSpec(
            "libra-oracle-from-first-return",
            "diagnostic: Libra with routing that knows every episode's final length from "
            "its first tool return on (not at its start)",
            split="planner",
            hetero=True,
            routing="oracle",
            replan=True,
            elastic=True,
            oracle_from=1,
        ),
    )
}

PAPER_TP = 2
"""The rollout TP size of the paper's matched control (docs/baselines.md, "As the paper
ran them")."""


def _as_paper_ran(spec: SystemSpec) -> SystemSpec:
    return replace(
        spec,
        name=f"{spec.name}@tp{PAPER_TP}",
        summary=f"{spec.summary}; rollout on TP-{PAPER_TP} instances, as the paper ran it",
        rollout_tp=PAPER_TP,
    )


SYSTEMS.update(
    (v.name, v)
    for v in map(_as_paper_ran, (SYSTEMS[n] for n in ("verl-colocated", "verl-static-uniform",
                                                     "verl-greedy-heuristic",
                                                     "areal-static-optimal")))
)  # fmt: skip

BASELINES = ("verl-colocated", "verl-static-uniform", "verl-greedy-heuristic",
             "areal-static-optimal", "best-static-colocated")  # fmt: skip
"""The systems Libra is measured against (the best of them per run is the bar)."""

GROUPS = {
    "all": [n for n in SYSTEMS if not n.startswith("libra-oracle") and "@" not in n],
    "paper-tp": [*(n for n in SYSTEMS if n.endswith(f"@tp{PAPER_TP}")), "libra"],
    "baselines": [*BASELINES, "libra"],
    "ladder": ["verl-static-uniform", "libra-homogeneous", "libra-hetero-tp", "libra-cmlfq",
               "libra"],
}  # fmt: skip
"""Names `--systems` also accepts."""


def resolve(names: str) -> list[SystemSpec]:
    """`all`, `baselines`, `ladder`, or a comma-separated list of system names."""
    out: list[str] = []
    for item in (n.strip() for n in names.split(",")):
        if not item:
            continue
        if item in GROUPS:
            out += GROUPS[item]
        elif item in SYSTEMS:
            out.append(item)
        else:
            known = ", ".join([*GROUPS, *SYSTEMS])
            raise ConfigError(f"unknown system {item!r}; known: {known}")
    if not out:
        raise ConfigError("--systems names no system; pass e.g. all or libra,verl-colocated")
    return [SYSTEMS[n] for n in dict.fromkeys(out)]


__all__ = ["BASELINES", "GROUPS", "PAPER_TP", "SYSTEMS", "OracleStart", "SystemSpec", "resolve"]
