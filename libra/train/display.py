"""What the user watches: a panel redrawn in place on a terminal, one line per step
elsewhere (logs, CI). Rendering is pure (`render(view) -> lines`); `Display` only writes.

    libra train · arith · step 12/40 [#########...............] 3m12s · eta 6m40s
      reward    0.61 (first steps 0.35)   val 0.70 @ v10   groups 8 kept, 3 dropped
      tokens/s  4,210 end-to-end · 1,350 generated · 3,900 trained
      workers   rollout: rollout0 hybrid0 · train: train0 · switches 1
      queues    episodes in flight 48 · waiting for a slot 5 · migrations 3
      planner   v3: hybrid0 -> train (gain 640 s > cost 5.1 s)
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any


@dataclass(slots=True)
class View:
    """Everything the panel shows (the loop updates it; the display reads it)."""

    env: str = ""
    phase: str = "starting"
    """starting, warm start, training, finishing."""
    step: int = 0
    steps: int = 0
    started: float = field(default_factory=time.monotonic)
    eta_from: tuple[float, int] | None = None
    """(time, step) of the first step this process finished: the ETA is timed from it.
    That first step also filled the pipeline (its batch was rolled out with no training
    beside it) and a resumed run starts mid-way, so timing from the phase's start made
    the ETA jump at step 1."""
    reward: float | None = None
    reward_first: float | None = None
    val_reward: float | None = None
    val_version: int | None = None
    kept: int = 0
    dropped: int = 0
    tokens_per_s: float | None = None
    gen_tokens_per_s: float | None = None
    train_tokens_per_s: float | None = None
    workers: dict[str, list[str]] = field(default_factory=dict)
    """role -> worker ids (`rollout`, `train`, `switching`)."""
    switches: int = 0
    in_flight: int = 0
    waiting: int = 0
    """Groups that could not start: every admissible step's slots are taken."""
    validating: int = 0
    migrations: int = 0
    last_decision: str = ""
    note: str = ""
    """A one-off line (warm-start progress, stopping...)."""

    def stepped(self, step: int, now: float | None = None) -> None:
        self.step = step
        if self.eta_from is None:
            self.eta_from = (time.monotonic() if now is None else now, step)


def _dur(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _bar(done: int, total: int, width: int = 24) -> str:
    n = int(width * done / total) if total else 0
    return "[" + "#" * n + "." * (width - n) + "]"


def render(v: View, now: float | None = None) -> list[str]:
    now = time.monotonic() if now is None else now
    elapsed = now - v.started
    head = f"libra train · {v.env} · "
    if v.phase != "training":
        lines = [head + f"{v.phase} · {_dur(elapsed)}"]
        if v.note:
            lines.append("  " + v.note)
        return lines
    eta = ""
    if v.eta_from is not None and v.step > v.eta_from[1]:  # from the second step on
        t0, s0 = v.eta_from
        eta = f" · eta {_dur((now - t0) / (v.step - s0) * (v.steps - v.step))}"
    roles = " · ".join(f"{r}: {' '.join(ids) or '-'}" for r, ids in v.workers.items())
    val = f"val {_f(v.val_reward)} @ v{v.val_version}" if v.val_version is not None else "val -"
    lines = [
        head + f"step {v.step}/{v.steps} {_bar(v.step, v.steps)} {_dur(elapsed)}{eta}",
        f"  reward    {_f(v.reward)} (first steps {_f(v.reward_first)})   {val}   "
        f"groups {v.kept} kept, {v.dropped} dropped",
        f"  tokens/s  {_f(v.tokens_per_s, ',.0f')} end-to-end · "
        f"{_f(v.gen_tokens_per_s, ',.0f')} generated · {_f(v.train_tokens_per_s, ',.0f')} trained",
        f"  workers   {roles} · switches {v.switches}",
        f"  queues    episodes in flight {v.in_flight} · groups waiting for a slot {v.waiting}"
        f" · validating {v.validating} · migrations {v.migrations}",
    ]
    if v.last_decision:
        lines.append(f"  planner   {v.last_decision}")
    if v.note:
        lines.append(f"  {v.note}")
    return lines


def step_line(row: dict[str, Any]) -> str:
    """The one-line form of a metrics row (non-terminal output)."""
    roles = row.get("roles", {})
    val = row.get("val_reward")
    return (
        f"step {row['step']:>4}  reward {row['reward']:.3f}  "
        f"val {'-' if val is None else f'{val:.3f}'}  "
        f"tok/s {row['tokens_per_s']:,.0f}  "
        f"roles {roles.get('rollout', 0)}R/{roles.get('train', 0)}T  "
        f"dropped {row.get('groups_dropped', 0)}  {row['step_s']:.1f}s"
        + (f"  errors {row['errors']}/{row['episodes']}" if row.get("errors") else "")
    )


class Display:
    """`mode`: live (redraw in place), lines (a line per step), off."""

    def __init__(self, mode: str, stream: IO[str] | None = None):
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "live" if self.stream.isatty() else "lines"
        self.mode = mode
        self._drawn = 0

    def draw(self, view: View) -> None:
        if self.mode != "live":
            return
        lines = render(view)
        out = ("\x1b[F\x1b[2K" * self._drawn) + "".join(f"\x1b[2K{ln}\n" for ln in lines)
        self.stream.write(out)
        self.stream.flush()
        self._drawn = len(lines)

    def line(self, text: str) -> None:
        """A line that stays (events, steps in `lines` mode, messages)."""
        if self.mode == "off":
            return
        if self.mode == "live":
            self.stream.write("\x1b[F\x1b[2K" * self._drawn)
            self._drawn = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def step(self, row: dict[str, Any]) -> None:
        if self.mode == "lines":
            self.line(step_line(row))


__all__ = ["Display", "View", "render", "step_line"]
