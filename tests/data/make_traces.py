"""Write the frozen traces in this folder (run from the repository root):

    .venv/bin/python tests/data/make_traces.py

They were written once, before any routing policy was tuned, and are never regenerated
to suit a policy: tests and `docs/benchmarks.md` read them as they are. The held-out
family changes the structure as well as the numbers (a page-fetch tool with large
payloads, three-hop questions, other failure rates, stronger drift, a dataset small
enough that prompts recur), so that a policy tuned to one generator shows it there.
"""

from __future__ import annotations

import dataclasses
import gzip
import sys
from pathlib import Path
from typing import Any

from libra.sim import workloads
from libra.sim.workloads import TaskClass, ToolSpec

HERE = Path(__file__).parent

HELDOUT: dict[str, Any] = {
    "name": "search-r1-heldout",
    "dataset_size": 256,
    "max_turns": 12,
    "prompt_template_tokens": 400,
    "classes": (
        TaskClass(name="single", weight=0.4, question_tokens=(15.0, 0.4), need=(1, 1),
                  skill=(4.0, 2.0), p_direct=0.1),
        TaskClass(name="bridge", weight=0.4, question_tokens=(28.0, 0.4), need=(2, 2),
                  skill=(3.0, 3.0)),
        TaskClass(name="compose", weight=0.2, question_tokens=(40.0, 0.4), need=(3, 4),
                  skill=(2.0, 3.0)),
    ),
    "tools": (
        ToolSpec(name="search", weight=3.0, ok_payload=(650.0, 0.25), error_payload=(40.0, 0.2),
                 max_payload=1_000, p_error=0.06, p_timeout=0.03, latency_s=(0.5, 0.8),
                 timeout_s=15.0),
        ToolSpec(name="fetch", weight=1.0, ok_payload=(2_500.0, 0.8), error_payload=(30.0, 0.2),
                 max_payload=8_000, p_error=0.1, p_timeout=0.05, latency_s=(1.5, 0.8),
                 timeout_s=30.0),
    ),
    "turn_tokens": 700.0,
    "first_turn": 2.0,
    "final_turn": 1.0,
    "fix_turn": 0.8,
    "sigma_turn": 0.5,
    "sigma_episode": 0.4,
    "sigma_task": 0.45,
    "miss_growth": 0.05,
    "read_coef": 0.6,
    "p_give_up": 0.25,
    "p_stuck": 0.12,
    "drift_len": 0.8,
    "drift_tool": 0.2,
    "error_halflife": 8.0,
    "error_floor": 0.3,
}  # fmt: skip

# search-r1-causal (version 1) and its held-out sibling: written in one commit, with
# their calibration numbers (tests/data/calibration.py), before any routing policy or
# ceiling was run on them (docs/workloads.md, "search-r1-causal"). The sibling changes
# structure: five short results per query, so a result list and an empty one fall in
# the same payload size class; three question classes (one to four hops); 10 turns;
# other empty / malformed / timeout rates; less polarised answerability; noisier,
# more verbose turns with a long first one; stronger drift; 256 prompts that recur.
_CAUSAL = workloads.spec("search-r1-causal")
CAUSAL_HELDOUT: dict[str, Any] = {
    "dataset_size": 256,
    "max_turns": 10,
    "prompt_template_tokens": 400,
    "classes": (
        TaskClass(name="single", weight=0.4, question_tokens=(15.0, 0.4), need=(1, 1),
                  skill=(1.5, 1.0), p_direct=0.08),
        TaskClass(name="bridge", weight=0.4, question_tokens=(28.0, 0.4), need=(2, 2),
                  skill=(1.5, 1.2)),
        TaskClass(name="compose", weight=0.2, question_tokens=(40.0, 0.4), need=(3, 4),
                  skill=(1.2, 1.2)),
    ),
    "tools": (
        dataclasses.replace(_CAUSAL.tools[0], ok_payload=(380.0, 0.35), max_payload=800,
                            p_error=0.06, p_timeout=0.03, latency_s=(1.2, 0.8)),
        dataclasses.replace(_CAUSAL.tools[1], weight=0.4, p_timeout=0.03),
        dataclasses.replace(_CAUSAL.tools[2], weight=0.5),
    ),
    "turn_tokens": 700.0,
    "first_turn": 2.0,
    "final_turn": 1.0,
    "fix_turn": 0.8,
    "sigma_turn": 0.5,
    "sigma_episode": 0.35,
    "sigma_task": 0.45,
    "miss_growth": 0.05,
    "read_coef": 0.6,
    "p_give_up": 0.25,
    "p_stuck": 0.12,
    "drift_len": 0.8,
    "drift_tool": 0.2,
    "error_halflife": 8.0,
    "error_floor": 0.3,
}  # fmt: skip

# file -> (workload, steps, prompts per step, group, seed, params)
TRACES: dict[str, tuple[str, int, int, int, int, dict[str, Any]]] = {
    "search-r1.jsonl.gz": ("search-r1", 16, 32, 16, 0, {}),
    "search-r1-subset.jsonl.gz": ("search-r1", 16, 32, 16, 0, {"dataset_size": 128}),
    "search-r1-heldout.jsonl.gz": ("search-r1", 16, 32, 16, 1, HELDOUT),
    "r2e-gym.jsonl.gz": ("r2e-gym", 12, 16, 16, 0, {}),
    "dapo-math.jsonl.gz": ("dapo-math", 12, 16, 16, 0, {}),
    "search-r1-causal-v1.jsonl.gz": ("search-r1-causal", 16, 32, 16, 11, {}),
    "search-r1-causal-heldout-v1.jsonl.gz": ("search-r1-causal", 16, 32, 16, 12, CAUSAL_HELDOUT),
}


def write(file: str) -> int:
    name, steps, prompts, group, seed, params = TRACES[file]
    n = 0
    # mtime=0: the same trace gives the same bytes
    with gzip.GzipFile(HERE / file, "wb", mtime=0) as f:
        for step in range(steps):
            for rec in workloads.sample(name, prompts, group, step=step, seed=seed, params=params):
                rec.seq = n
                n += 1
                f.write(rec.model_dump_json(exclude_defaults=True).encode() + b"\n")
    return n


if __name__ == "__main__":
    # optional: file names to write (default: all; the others are byte-identical anyway)
    for file in sys.argv[1:] or TRACES:
        print(file, write(file))
