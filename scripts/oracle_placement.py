"""Which part of the routing oracle's advantage a causal router could reach.

On one fixed mixed layout per cell (the `ceiling` search's), the whole run (10 steps)
with the episodes started five ways and routed after their start as named:

- the oracle: each episode placed exactly in the bucket of its final length (no
  spilling), never moved (`ceiling`'s routing);
- every final length known at the start, the episode dispatched as any policy's answer
  is (a floor: the least-loaded instance of that bucket or a larger one), the oracle's
  answer at each tool return;
- C-MLFQ's start, the oracle's answer from the first tool return on;
- the same, the start placed exactly in the bucket C-MLFQ answers (no spilling);
- C-MLFQ's start, the first turn stopped after 64 tokens and the episode moved to the
  bucket of its final length (the oracle mid-turn; a re-prefill of the prompt and the
  64 tokens), the oracle from the first return on;
- C-MLFQ's start and routing (Libra's);
- C-MLFQ with a causal mid-turn rule: a turn in a bucket below the largest stops when
  the context reaches 10% of the bucket's bound and moves up one bucket;

and, for comparison, Libra's own run (its pilots choose the layout it starts on).

    python scripts/oracle_placement.py search-r1:48:0 dapo-math:48:0 ...

docs/simulation.md, "What the oracle's placement is worth", has the figures. The
variants replace `Fleet` methods while one simulation runs: they are diagnostics, not
policies a user can choose.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from libra.sim.cluster import Simulation
from libra.sim.config import SimConfig
from libra.sim.fleet import Fleet, Run
from libra.sim.runner import build_env
from libra.sim.search import ceiling
from libra.sim.systems import SYSTEMS

QUANTUM = 64


def start_by_known_length(self: Fleet, ep: Any, batch: int, now: float) -> None:
    """Start each episode in its final length's bucket as a floor (spilling allowed)."""
    self._n += 1
    self._place(Run(ep, batch, f"{batch}/{self._n}", now), self._fits(ep.total), now, None)


def start_without_spilling(self: Fleet, ep: Any, batch: int, now: float) -> None:
    """C-MLFQ's start, placed in exactly the bucket it answers (no spilling)."""
    self.spill = False
    try:
        ORIGINAL["start"](self, ep, batch, now)
    finally:
        self.spill = True


def _first(run: Run) -> bool:
    return run.turn == 0 and run.ctx == run.ep.prompt


def submit_quantum(self: Fleet, run: Run, inst: Any, bi: int, now: float) -> None:
    """Stop each first turn in a bucket below the largest after `QUANTUM` tokens."""
    if _first(run) and bi < self._last and run.left > QUANTUM:
        run.seg, run.inst = QUANTUM, inst
        inst.submit(run, now)
    else:
        ORIGINAL["_submit"](self, run, inst, bi, now)


def move_after_quantum(self: Fleet, inst: Any, run: Run, now: float) -> None:
    """After the quantum, move the episode up to its final length's bucket (or go on
    where it runs)."""
    if not (_first(run) and run.seg == QUANTUM and run.left > QUANTUM):
        ORIGINAL["_seg_done"](self, inst, run, now)
        return
    run.ctx += QUANTUM
    run.left -= QUANTUM
    to, bi = self._fits(run.ep.total), self._tpi[run.tp]
    if to > bi:
        self._place(run, to, now, "policy")
    else:
        run.pre_tokens, run.pre_ctx = 0, run.ctx
        ORIGINAL["_submit"](self, run, inst, bi, now)


def submit_to_mark(self: Fleet, run: Run, inst: Any, bi: int, now: float) -> None:
    """A causal mid-turn rule (C-MLFQ's episodes only): a turn in a bucket below the
    largest stops when the context reaches `MARK` x the bucket's bound."""
    mark = int(MARK * self._bounds[bi])
    left = min(run.left, self._bounds[bi] - run.ctx)
    if self._consult and not self.oracle and bi < self._last and run.ctx < mark < run.ctx + left:
        run.seg, run.inst = mark - run.ctx, inst
        MARKED.add(run)
        inst.submit(run, now)
    else:
        ORIGINAL["_submit"](self, run, inst, bi, now)


def up_at_mark(self: Fleet, inst: Any, run: Run, now: float) -> None:
    """At the mark, the episode moves up one bucket (a re-prefill of its context)."""
    if run not in MARKED:
        ORIGINAL["_seg_done"](self, inst, run, now)
        return
    MARKED.discard(run)
    run.ctx += run.seg
    run.left -= run.seg
    self._place(run, min(self._tpi[run.tp] + 1, self._last), now, "policy")
    if self.on_idle is not None and inst.role == "live" and not inst.active and not inst.queue:
        self.on_idle(inst, now)


MARK = 0.1
MARKED: set[Run] = set()
ORIGINAL = {name: getattr(Fleet, name) for name in ("start", "_submit", "_seg_done")}


@contextmanager
def patched(methods: dict[str, Any]) -> Iterator[None]:
    """`Fleet` with `methods` replaced (before the simulation makes its instances,
    which keep the fleet's `_seg_done` as their callback)."""
    for name, fn in methods.items():
        setattr(Fleet, name, fn)
    try:
        yield
    finally:
        for name in methods:
            setattr(Fleet, name, ORIGINAL[name])


def cell(workload: str, gpus: int, seed: int) -> None:
    env = build_env(SimConfig(workload=workload, gpus=gpus, steps=10, seed=seed))
    layout = ceiling(env).best
    print(f"{workload} {gpus} GPUs seed {seed}: {layout.describe()['rollout']}")
    base = SYSTEMS["ceiling"]
    from_return, cmlfq = replace(base, oracle_from=1), replace(base, routing="cmlfq")
    mid = {"_submit": submit_quantum, "_seg_done": move_after_quantum}
    variants: list[tuple[str, Any, dict[str, Any]]] = [
        ("oracle: exact placement at the start", base, {}),
        ("lengths known at the start, dispatched by load", from_return,
         {"start": start_by_known_length}),
        ("C-MLFQ start, oracle from return 1", from_return, {}),
        ("C-MLFQ start unspilled, oracle from return 1", from_return,
         {"start": start_without_spilling}),
        (f"C-MLFQ start, oracle after {QUANTUM} tokens", from_return, mid),
        ("C-MLFQ", cmlfq, {}),
        (f"C-MLFQ, a turn at {MARK:.0%} of its bucket's bound moves up", cmlfq,
         {"_submit": submit_to_mark, "_seg_done": up_at_mark}),
    ]  # fmt: skip
    for label, spec, methods in variants:
        with patched(methods):
            sim = Simulation(spec, env, layout)
            sim.run()
        moves = sim.fleet.moves["policy"] + sim.fleet.moves["overflow"]
        print(f"  {label:54s} {sim.loop.now:7.0f} s  {moves:5d} moves")
    sim = Simulation(SYSTEMS["libra"], env)
    sim.run()
    label = f"Libra (starts on {sim.initial_layout.describe()['rollout']})"
    print(f"  {label:54s} {sim.loop.now:7.0f} s")


def main(cells: list[str]) -> None:
    for c in cells:
        workload, gpus, seed = c.split(":")
        cell(workload, int(gpus), int(seed))


if __name__ == "__main__":
    main(sys.argv[1:])
