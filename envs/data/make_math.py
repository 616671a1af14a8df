"""Regenerate `math.jsonl`, the math env's shipped tasks.

Sources (both on PyPI, installed with Libra's env extras):
- `champ-dataset` 1.0.0 (MIT): CHAMP, 270 competition problems with final answers
  (Mao et al., 2024). Kept: problems whose answer math-verify parses (numbers,
  expressions), not prose answers.
- `reasoning-gym` (Apache-2.0): procedurally generated problems from the generators
  in `GENERATORS`, deterministic for a seed.

    python envs/data/make_math.py [--champ 64] [--gym 64] [--seed 0] [--out FILE]

Bigger sets for training: raise the counts and write elsewhere, then pass the file as
`--tasks` (it is read through `datasets` when large).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
GENERATORS = [
    "basic_arithmetic",
    "gsm_symbolic",
    "fraction_simplification",
    "lcm",
    "gcd",
    "simple_equations",
    "decimal_arithmetic",
    "prime_factorization",
]


def champ(n: int, seed: int) -> list[dict[str, Any]]:
    import champ_dataset
    from math_verify import parse

    rows = []
    for pid, p in sorted(champ_dataset.load("v0").problems.items()):
        if parse(p.answer) and len(p.answer) < 40:
            rows.append(
                {
                    "id": f"champ-{pid}",
                    "question": p.text,
                    "answer": p.answer,
                    "source": f"champ:{p.category}",
                }
            )
    random.Random(seed).shuffle(rows)
    return rows[:n]


def gym(n: int, seed: int) -> list[dict[str, Any]]:
    import reasoning_gym

    per = -(-n // len(GENERATORS))
    rows = []
    for name in GENERATORS:
        for i, entry in enumerate(reasoning_gym.create_dataset(name, size=per, seed=seed)):
            rows.append(
                {
                    "id": f"gym-{name}-{seed}-{i}",
                    "question": entry["question"],
                    "answer": str(entry["answer"]),
                    "source": f"reasoning-gym:{name}",
                }
            )
    random.Random(seed).shuffle(rows)
    return rows[:n]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--champ", type=int, default=64)
    p.add_argument("--gym", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=HERE / "math.jsonl")
    args = p.parse_args()
    rows = champ(args.champ, args.seed) + gym(args.gym, args.seed)
    with open(args.out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{len(rows)} tasks -> {args.out}")


if __name__ == "__main__":
    main()
