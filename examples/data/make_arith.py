"""Regenerate the arith task files of examples/cpu-train.toml (deterministic):

    python examples/data/make_arith.py

Training tasks come from seed 101, held-out tasks from seed 202 with any question that
also occurs in training removed (`libra train` removes shared ids as well).
"""

import json
from pathlib import Path

from libra.envs.arith import make_tasks

HERE = Path(__file__).parent


def main() -> None:
    train = make_tasks(2000, seed=101)
    seen = {t["question"] for t in train}
    val = [t for t in make_tasks(400, seed=202) if t["question"] not in seen][:128]
    for name, tasks in (("arith-train.jsonl", train), ("arith-val.jsonl", val)):
        with open(HERE / name, "w") as f:
            f.writelines(json.dumps(t) + "\n" for t in tasks)


if __name__ == "__main__":
    main()
