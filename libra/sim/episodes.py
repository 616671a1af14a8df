"""What the simulator replays: one training step's episodes, turn by turn.

An `Episode` is a trajectory record reduced to what a rollout on virtual time needs, per
turn: model tokens, tool tokens, the tool-return states routing sees, and the tools'
summed latency. The record itself rides along: routing policies learn from it
(`on_finish`) and the planner and the training cost model read it (`WorkloadStats`).

`Workload` gives the batch of every training step, generated once and shared by every
system of a run (so systems compare on the same episodes): from a generator
(`libra.sim.workloads`, drifting with the step) or from recorded traces (records grouped
by their `step` field, in order).
"""

from __future__ import annotations

import gzip
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from libra.errors import ConfigError
from libra.routing import ToolState


class SimReturn(NamedTuple):
    tool: str
    status: str
    payload_tokens: int
    latency_s: float


class SimTurn(NamedTuple):
    model_tokens: int
    tool_tokens: int
    tool_returns: tuple[SimReturn, ...]


@dataclass(frozen=True, slots=True)
class SimRecord:
    """The fields of a trajectory record that routing policies learn from and the
    planner reads (`WorkloadStats.from_records`), without validating a full record."""

    id: str
    task_id: str
    step: int
    status: str
    prompt_tokens: int
    total_tokens: int
    turns: tuple[SimTurn, ...]


@dataclass(frozen=True, slots=True)
class Episode:
    record: Any
    """The trajectory record (`libra.Trajectory` or anything shaped like one)."""
    task_id: str
    prompt: int
    gen: tuple[int, ...]
    """Model tokens per turn."""
    tool: tuple[int, ...]
    """Tool tokens appended after each turn (0 after the last)."""
    latency: tuple[float, ...]
    """Seconds the turn's tool calls take (the GPU serves others meanwhile)."""
    states: tuple[tuple[ToolState, ...], ...]
    """Tool-return states after each turn, as routing sees them."""
    generated: int
    total: int

    @property
    def turns(self) -> int:
        return len(self.gen)

    @classmethod
    def from_data(cls, d: dict[str, Any]) -> Episode:
        """From plain record data: a generator's (`libra.sim.workloads.sample_data`) or a
        trace line's. Needs `task_id`, `prompt_tokens` and per turn `model_tokens`; the
        rest defaults (no tool returns, status ok)."""
        turns = tuple(
            SimTurn(
                int(t["model_tokens"]),
                int(t.get("tool_tokens", 0)),
                tuple(
                    SimReturn(
                        str(x.get("tool", "")),
                        str(x.get("status", "ok")),
                        int(x.get("payload_tokens", 0)),
                        float(x.get("latency_s", 0.0)),
                    )
                    for x in t.get("tool_returns") or ()
                ),
            )
            for t in d.get("turns") or ()
        )
        prompt = int(d["prompt_tokens"])
        total = int(d.get("total_tokens") or 0) or prompt + sum(
            t.model_tokens + t.tool_tokens for t in turns
        )
        counts = [prompt, total, *(x for t in turns for x in (t.model_tokens, t.tool_tokens))]
        counts += [x.payload_tokens for t in turns for x in t.tool_returns]
        if min(counts) < 0 or int(d.get("step", 0)) < 0:  # ran as -54 token/s
            raise ValueError("token counts and the step must be >= 0")
        if not all(0 <= x.latency_s < math.inf for t in turns for x in t.tool_returns):
            raise ValueError("tool latencies must be finite and >= 0")
        record = SimRecord(
            str(d.get("id", "")), str(d["task_id"]), int(d.get("step", 0)),
            str(d.get("status", "ok")), prompt, total, turns,
        )  # fmt: skip
        return cls.from_record(record)

    @classmethod
    def from_record(cls, r: Any) -> Episode:
        gen, tool, lat, states = [], [], [], []
        for t in r.turns:
            gen.append(int(t.model_tokens))
            tool.append(int(t.tool_tokens))
            rets = list(t.tool_returns or [])
            lat.append(float(sum(x.latency_s for x in rets)))
            states.append(tuple(ToolState(x.tool, x.status, int(x.payload_tokens)) for x in rets))
        if not gen:  # a record without turns: one turn of everything after the prompt
            gen = [max(1, int(r.total_tokens) - int(r.prompt_tokens))]
            tool, lat, states = [0], [0.0], [()]
        prompt = int(r.prompt_tokens)
        return cls(
            record=r,
            task_id=str(r.task_id),
            prompt=prompt,
            gen=tuple(gen),
            tool=tuple(tool),
            latency=tuple(lat),
            states=tuple(states),
            generated=sum(gen),
            total=prompt + sum(gen) + sum(tool),
        )


class Workload:
    """The batches of a run: `batch(s)` is step s's list of episodes."""

    def __init__(self, name: str, batches: Sequence[Sequence[Episode]]):
        if not batches or not all(batches):
            raise ConfigError(f"workload {name!r} has an empty step; every step needs episodes")
        self.name = name
        self._batches = [list(b) for b in batches]

    @property
    def steps(self) -> int:
        return len(self._batches)

    def batch(self, step: int) -> list[Episode]:
        return self._batches[step]

    def records(self, step: int) -> list[Any]:
        return [e.record for e in self._batches[step]]

    @property
    def max_context(self) -> int:
        return max(e.total for b in self._batches for e in b)

    # --- sources --------------------------------------------------------------------
    @classmethod
    def generate(
        cls,
        name: str,
        steps: int,
        prompts: int,
        group: int,
        seed: int,
        params: dict[str, Any] | None = None,
    ) -> Workload:
        """`steps` batches of a named generator, step s drawn at policy version s."""
        from libra.sim import workloads

        batches = [
            [
                Episode.from_data(d)
                for d in workloads.sample_data(
                    name, prompts, group, step=s, seed=seed, params=params
                )
            ]
            for s in range(steps)
        ]
        return cls(name, batches)

    @classmethod
    def from_trace(cls, path: str | Path, steps: int) -> Workload:
        """The first `steps` training steps of a trace file (JSONL, or .jsonl.gz) of
        trajectory records, grouped by their `step` field."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--workload {str(path)!r}: no such trace file")
        opener: Any = gzip.open if p.suffix == ".gz" else open
        try:
            by_step = _read_trace(p, opener)
        except (EOFError, OSError) as e:  # a cut or broken gzip file; an unreadable one
            raise ConfigError(f"{p}: cannot be read whole ({e}); write the trace again") from None
        order = sorted(by_step)
        if len(order) < steps:
            if not order:
                raise ConfigError(f"{p}: holds no trajectory records; pass a trace of them")
            raise ConfigError(
                f"{p}: holds {len(order)} training steps, --steps asks for {steps}; "
                f"pass --steps {len(order)} or a longer trace"
            )
        return cls(p.name, [by_step[s] for s in order[:steps]])


def _read_trace(p: Path, opener: Any) -> dict[int, list[Episode]]:
    """A trace file's episodes by training step (a bad line: a `ConfigError` naming it)."""
    by_step: dict[int, list[Episode]] = {}
    with opener(p, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ep = Episode.from_data(orjson.loads(line))
            except (
                orjson.JSONDecodeError,
                KeyError,
                TypeError,
                ValueError,
                AttributeError,
            ) as e:
                what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
                raise ConfigError(
                    f"{p}:{lineno}: not a trajectory record ({what}); records need "
                    "task_id, prompt_tokens and turns with model_tokens"
                ) from None
            by_step.setdefault(ep.record.step, []).append(ep)
    return by_step


def prompt_lengths(batch: Iterable[Episode]) -> dict[str, float]:
    """Each prompt's typical final length in `batch`: the geometric mean over its samples
    (a GRPO group), by task id. What a perfect predictor of a prompt's difficulty could
    know before the first turn (`SystemSpec.oracle_start`), never an episode's own luck."""
    logs: dict[str, list[float]] = defaultdict(list)
    for ep in batch:
        logs[ep.task_id].append(math.log(max(1, ep.total)))
    return {k: math.exp(sum(v) / len(v)) for k, v in logs.items()}


__all__ = ["Episode", "SimRecord", "SimReturn", "SimTurn", "Workload", "prompt_lengths"]
