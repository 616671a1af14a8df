"""Which launcher starts a job's engines: local processes, or Ray actors on a cluster's
nodes (`[cluster] backend`). One choice for every job that starts engines (`libra
train`'s fleet, embedded or vLLM; the engines `libra rollout` and `libra serve-rollout`
launch)."""

from __future__ import annotations

from libra.cluster.config import ClusterSection
from libra.cluster.engines import EmbeddedLauncher, EngineLauncher, VllmLauncher


def place(section: ClusterSection, local: EmbeddedLauncher | VllmLauncher) -> EngineLauncher:
    """`local` itself, or (`backend = "ray"`) `local` run inside Ray actors, each on a
    node with the engine's CPUs (and GPUs, for a vLLM server on CUDA); joins the Ray
    cluster then (a missing `ray` or no cluster at `address` stops here, in one line)."""
    if section.backend == "local":
        return local
    from libra.cluster.raylaunch import RayLauncher, connect

    connect(section)
    return RayLauncher(local, section)


__all__ = ["place"]
