"""The trainer micro-step: forward + backward of a model folder, timed in its own process.

The child (`python -m libra.profiling.trainstep FOLDER --lengths 128,512 ...`) sets up
the way a trainer rank does (`libra.trainer.device`: the device, its threads), loads the
folder as the trainer does (`libra.trainer.model.load_model`) and runs the trainer's own
forward (`libra.trainer.grpo.token_logprobs`) and a backward over micro-batches of
random token ids; it prints one JSON line of timings. Its own process keeps torch out of
`libra profile` and gives the step the threads a trainer rank would have.

Each shape is run once untimed (allocations, first-call costs), then `repeats` times; the
fastest is kept (contention only adds time, as for the endpoints: `probe.py`), with every
repeat beside it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from libra.errors import ModelError


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainTiming:
    sequences: int
    length: int
    seconds: float
    repeats: tuple[float, ...]

    @property
    def tokens(self) -> int:
        return self.sequences * self.length

    @property
    def pairs(self) -> float:
        """Causal (query, key) pairs, as the cost model counts them (n^2 / 2 each)."""
        return self.sequences * self.length**2 / 2.0


def has_weights(folder: str | Path) -> bool:
    p = Path(folder)
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def measure(
    folder: str | Path,
    shapes: list[tuple[int, int]],
    *,
    repeats: int = 3,
    timeout_s: float = 600.0,
    python: str = sys.executable,
) -> tuple[list[TrainTiming], dict[str, object]]:
    """Time forward + backward for each (sequences, length) in a child process; returns
    the timings and what the child reports about itself (device, threads, dtype)."""
    cmd = [python, "-m", "libra.profiling.trainstep", str(folder), "--repeats", str(repeats)]
    cmd += ["--shapes", ",".join(f"{s}x{n}" for s, n in shapes)]
    try:
        out = subprocess.run(cmd, capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise ModelError(
            f"the trainer micro-step on {folder} took over {timeout_s:.0f} s; "
            "use shorter --train-lengths or --no-train-step"
        ) from None
    if out.returncode != 0:
        tail = out.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        raise ModelError(f"the trainer micro-step on {folder} failed: {tail[0]}")
    doc = json.loads(out.stdout.decode().strip().splitlines()[-1])
    timings = [
        TrainTiming(
            sequences=t["sequences"],
            length=t["length"],
            seconds=t["seconds"],
            repeats=tuple(t["repeats"]),
        )
        for t in doc.pop("timings")
    ]
    return timings, doc


def _run(folder: str, shapes: list[tuple[int, int]], repeats: int) -> dict[str, object]:
    import torch

    from libra.planner.profiles import load_model as load_profile
    from libra.trainer.device import CPU, init_process
    from libra.trainer.grpo import MicroBatch, token_logprobs
    from libra.trainer.model import load_model

    device = CPU  # the CPU micro-step; not timed on CUDA yet (docs/cost-model.md)
    init_process(device)
    model = load_model(folder)
    vocab = load_profile(folder).vocab
    gen = torch.Generator().manual_seed(0)
    timings = []
    for seqs, length in shapes:
        ids = torch.randint(1, int(vocab * 0.9), (seqs, length), generator=gen)
        mb = MicroBatch(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mask=torch.ones(seqs, length - 1),
            rollout=torch.full((seqs, length - 1), float("nan")),
            advantage=torch.ones(seqs, 1),
            lengths=[length] * seqs,
            prompt_lens=[1] * seqs,
        )

        def step(batch: MicroBatch = mb) -> float:
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            logp = token_logprobs(model, batch, 1.0, device=device)
            (-(logp * batch.mask).sum() / batch.mask.sum()).backward()
            return time.perf_counter() - t0

        step()
        runs = [step() for _ in range(repeats)]
        timings.append(
            {
                "sequences": seqs,
                "length": length,
                "seconds": min(runs),
                "repeats": runs,
            }
        )
    return {
        "device": device.type,
        "threads": torch.get_num_threads(),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "timings": timings,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m libra.profiling.trainstep")
    p.add_argument("folder")
    p.add_argument("--shapes", required=True, help="SEQSxLENGTH,... e.g. 2x128,2x512")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    doc = _run(a.folder, [(s[0], s[1]) for s in shapes], a.repeats)
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
