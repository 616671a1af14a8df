"""Random simulator cells off the grid: Libra against the best baseline, one line per cell.

The grid (`libra bench sim-grid`) is what issue #16 names; the result is also checked on
cells outside it. This draws N cells from workloads, models, hardware, GPU counts, seeds,
run lengths, prompts per step and staleness (the same draw for the same SEED), runs
`libra simulate ... --systems baselines --json` on each, and appends to OUT one JSON line
per cell: the command's arguments, Libra / the best baseline and which baseline that was,
or the error. Cells are independent: stop it any time, OUT keeps what finished.

    python scripts/sim_probe.py 202 40 probe.jsonl

docs/simulation.md, "The run's end, restarts in pilots, systems that cannot run", has
what it found.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

WORKLOADS = ["search-r1", "search-r1-causal", "r2e-gym", "dapo-math"]
MODELS = ["qwen3-4b", "qwen3-14b", "qwen3-32b", "qwen3-30b-a3b"]
HARDWARE = ["a800-80g", "h100-80g", "h200-141g"]
GPUS = [16, 24, 32, 40, 48, 64, 80, 96]


def draw(rng: random.Random) -> list[str]:
    argv = [
        "--workload", rng.choice(WORKLOADS), "--gpus", str(rng.choice(GPUS)),
        "--model", rng.choice(MODELS), "--hardware", rng.choice(HARDWARE),
        "--steps", str(rng.choice([10, 10, 20])), "--seed", str(rng.randrange(100)),
    ]  # fmt: skip
    if rng.random() < 0.25:
        argv += ["--prompts", str(rng.choice([8, 24, 64]))]
    if rng.random() < 0.15:
        argv += ["--staleness", "2"]
    return argv


def cell(argv: list[str]) -> dict[str, object]:
    cmd = [sys.executable, "-m", "libra", "simulate", *argv, "--systems", "baselines",
           "--jobs", "1", "--json"]  # fmt: skip
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    out: dict[str, object] = {"argv": " ".join(argv), "wall_s": round(time.perf_counter() - t0, 1)}
    if p.returncode:
        out["error"] = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        return out
    systems = json.loads(p.stdout)["systems"]
    ran = {r["system"]: r["throughput"] for r in systems if "error" not in r}
    if "libra" not in ran or len(ran) < 2:
        out["error"] = {r["system"]: r["error"] for r in systems if "error" in r}
        return out
    libra = ran.pop("libra")
    best = max(ran, key=lambda n: ran[n])
    out.update(libra_over_best_baseline=round(libra / ran[best], 4), best_baseline=best)
    return out


def main() -> None:
    seed, n, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    rng = random.Random(seed)
    with open(path, "a", encoding="utf-8") as f:
        for _ in range(n):
            row = cell(draw(rng))
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
