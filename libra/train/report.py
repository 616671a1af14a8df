"""The run folder's logs and plots.

    metrics.jsonl     one row per training step (docs/train.md lists the fields)
    decisions.jsonl   every planner decision, applied or not, with predicted gain and cost
    events.jsonl      what happened: role switches (with measured durations), trainer
                      joins and leaves, validations, checkpoints, warm start
    plots/*.png       reward per step (+ validation), throughput per step, roles over time
    tensorboard/      the metrics as scalars (optional)
    wandb/            the metrics in a Weights & Biases run (optional; offline with
                      WANDB_MODE=offline)

Appending is line-buffered and flushed, so a crash keeps every finished row; on resume
rows of steps after the checkpoint are dropped (they will be redone).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path
from typing import IO, Any

import orjson

from libra.errors import ConfigError
from libra.rollout.sink import whole_lines

log = logging.getLogger("libra.train")


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_bytes().splitlines():
        if line.strip():
            try:
                rows.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                continue  # a torn last line after a crash
    return rows


class JsonLog:
    """Append-only JSON lines (a torn last line left by a write that did not finish is
    cut off first: `libra.rollout.sink.whole_lines`)."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        whole_lines(path)
        self._f: IO[bytes] = open(path, "ab")  # noqa: SIM115 - closed in close()

    def write(self, row: dict[str, Any]) -> None:
        self._f.write(orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def truncate_after(path: Path, step: int, key: str = "step") -> None:
    """Keep rows with `key` <= step (resume: later rows will be written again)."""
    rows = [r for r in read_rows(path) if r.get(key) is None or r[key] <= step]
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


SUPERSEDED = "trajectories-superseded.jsonl"
"""Where a resume moves the episodes its checkpoint does not cover (next to
`trajectories.jsonl`)."""


def set_aside_groups(path: Path, first: int) -> int:
    """Resume: move the episodes of groups `g{first:06d}` and later out of `path` (the
    trajectories) into `SUPERSEDED` beside it; returns how many. A run that stopped
    without a checkpoint at its end (a lost core replica, a kill) recorded them after
    its last checkpoint, which never trained on them; the resumed run draws those groups
    again, under the same ids. Moved, not deleted: nothing finished is lost, and each id
    appears once in `trajectories.jsonl`."""
    if not path.is_file():
        return 0
    whole_lines(path)  # a write cut short by the stop: not a record
    keep: list[bytes] = []
    moved: list[bytes] = []
    for lineno, line in enumerate(path.read_bytes().splitlines(keepends=True), 1):
        if not line.strip():
            continue
        try:
            gid = str(orjson.loads(line).get("group_id", ""))
        except (orjson.JSONDecodeError, AttributeError):
            raise ConfigError(
                f"{path}:{lineno}: not a trajectory record, so the resume cannot tell which "
                "episodes its checkpoint covers; repair the line or move the file away"
            ) from None
        n = gid[1:7]  # ASCII digits: `int` refuses some that `isdigit` takes ("²")
        later = gid.startswith("g") and n.isascii() and n.isdigit() and int(n) >= first
        (moved if later else keep).append(line)
    if moved:
        with open(path.with_name(SUPERSEDED), "ab") as f:
            f.write(b"".join(moved))
        path.write_bytes(b"".join(keep))
    return len(moved)


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row, `roles` flattened to `roles/<role>`."""
    out = {k: v for k, v in row.items()
           if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}  # fmt: skip
    out.update({f"roles/{role}": n for role, n in row.get("roles", {}).items()})
    return out


def _wandb_run(out: Path, config: dict[str, Any]) -> Any:
    """A wandb run writing under `out/wandb`; a resumed run folder continues its run (the
    id is kept in `out/wandb-run-id`)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            "report.wandb needs the wandb package: pip install 'libra-rl[wandb]' "
            "(or set report.wandb = false)"
        ) from None
    id_file = out / "wandb-run-id"
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
    id_file.write_text(run_id + "\n")
    (out / "wandb").mkdir(exist_ok=True)
    return wandb.init(
        project=os.environ.get("WANDB_PROJECT", "libra"),
        name=out.resolve().name,
        id=run_id,
        resume="allow",
        dir=str(out),
        config=config,
    )


class Report:
    def __init__(
        self,
        out: Path,
        *,
        tensorboard: bool = False,
        wandb: dict[str, Any] | None = None,
        t0: float | None = None,
    ):
        """`wandb`: the run's config to log to a Weights & Biases run (None: no wandb)."""
        self.out = out
        self.t0 = time.time() if t0 is None else t0
        self.metrics = JsonLog(out / "metrics.jsonl")
        self.decisions = JsonLog(out / "decisions.jsonl")
        self.events = JsonLog(out / "events.jsonl")
        self.tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError(
                    "report.tensorboard needs the tensorboard package: pip install tensorboard "
                    "(or set report.tensorboard = false)"
                ) from None
            self.tb = SummaryWriter(str(out / "tensorboard"))
        self.wandb = None if wandb is None else _wandb_run(out, wandb)

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        row = {"t": round(time.time() - self.t0, 3), "event": kind, **fields}
        self.events.write(row)
        return row

    def step(self, row: dict[str, Any]) -> None:
        self.metrics.write(row)
        if self.tb is not None:
            for k, v in _scalars(row).items():
                self.tb.add_scalar(k, v, row["step"])
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(_scalars(row), step=row["step"])

    def decision(self, row: dict[str, Any]) -> None:
        self.decisions.write(row)

    def close(self) -> None:
        for f in (self.metrics, self.decisions, self.events):
            f.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def write_plots(out: Path) -> list[Path]:
    """reward.png, throughput.png, roles.png from metrics.jsonl (empty list if the
    plotting library is missing: the logs are the record, plots are a view)."""
    rows = read_rows(out / "metrics.jsonl")
    if not rows:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("plots skipped: matplotlib is not installed (pip install matplotlib)")
        return []
    folder = out / "plots"
    folder.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in rows]
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["reward"] for r in rows], marker=".", label="training reward (per step)")
    events = read_rows(out / "events.jsonl")
    val = sorted({e["version"]: e["reward"] for e in events if e["event"] == "validation"}.items())
    if val:
        ax.plot(*zip(*val, strict=True), marker="o", label="held-out validation")
    ax.set(xlabel="step (policy version)", ylabel="mean reward", ylim=(-0.02, 1.02), title="Reward")
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(_save(fig, folder / "reward.png", plt))

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        steps,
        [r["tokens_per_s"] for r in rows],
        marker=".",
        label="end-to-end (batch tokens / step time)",
    )
    ax.plot(
        steps,
        [r["gen_tokens_per_s"] for r in rows],
        marker=".",
        label="generated (model tokens / step time)",
    )
    ax.set(xlabel="step", ylabel="tokens / s", title="Throughput")
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(_save(fig, folder / "throughput.png", plt))

    fig, ax = plt.subplots(figsize=(7, 3.5))
    roll = [r["roles"].get("rollout", 0) for r in rows]
    train = [r["roles"].get("train", 0) for r in rows]
    ax.stackplot(steps, roll, train, labels=["rollout", "training"], step="post", alpha=0.8)
    ax.set(xlabel="step", ylabel="workers (engines, trainer replicas)",
           title="Worker roles over time")  # fmt: skip
    ax.legend(loc="upper left")
    written.append(_save(fig, folder / "roles.png", plt))
    return written


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = [
    "SUPERSEDED",
    "JsonLog",
    "Report",
    "read_rows",
    "set_aside_groups",
    "truncate_after",
    "write_plots",
]
