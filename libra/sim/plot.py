"""`libra simulate --plot DIR`: throughput per step by system, and Libra's GPU allocation
over time (matplotlib, written as PNG files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from libra.errors import ConfigError

SMOOTH = 5
"""Steps per moving-average window of the per-step throughput (asynchronous pipelines
alternate long and short steps)."""


def _smooth(xs: list[float]) -> list[float]:
    out = []
    for i in range(len(xs)):
        win = xs[max(0, i - SMOOTH + 1) : i + 1]
        out.append(sum(win) / len(win))
    return out


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib: pip install 'libra-rl[plot]' (or drop --plot)"
        ) from None
    return plt


def write_plots(result: dict[str, Any], out: Path) -> list[Path]:
    """The two figures of a `simulate` result; returns the files written."""
    plt = _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    systems = [r for r in result["systems"] if "error" not in r]  # those that ran
    title = (
        f"{result['workload']['name']}, {result['config']['model']} on "
        f"{result['config']['gpus']} x {result['config']['hardware']}"
    )
    files = []

    fig, ax = plt.subplots(figsize=(9, 5))
    for r in systems:
        steps = [p["step"] for p in r["per_step"]]
        ax.plot(steps, _smooth([p["throughput"] for p in r["per_step"]]), label=r["system"], lw=1.2)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"generated token/s per step ({SMOOTH}-step moving average)")
    ax.set_title(f"Throughput per step: {title}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    files.append(out / "throughput.png")
    fig.savefig(files[-1], dpi=120)
    plt.close(fig)

    pick = next((r for r in systems if r["system"] == "libra"), systems[0])
    t = [row[0] / 3600 for row in pick["timeline"]]
    train = [row[1] - row[3] for row in pick["timeline"]]
    hybrid = [row[3] for row in pick["timeline"]]
    rollout = [row[2] for row in pick["timeline"]]
    end = pick["time_s"] / 3600
    t, train, hybrid, rollout = (
        t + [end],
        train + train[-1:],
        hybrid + hybrid[-1:],
        rollout + rollout[-1:],
    )
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.stackplot(
        t,
        train,
        hybrid,
        rollout,
        labels=["training (core)", "hybrid workers training", "rollout"],
        step="post",
        alpha=0.85,
    )
    ax.set_xlabel("time (hours)")
    ax.set_ylabel("GPUs")
    ax.set_ylim(0, result["config"]["gpus"])
    ax.set_title(f"GPU allocation over time: {pick['system']}, {title}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    files.append(out / f"allocation-{pick['system']}.png")
    fig.savefig(files[-1], dpi=120)
    plt.close(fig)
    return files


__all__ = ["write_plots"]
