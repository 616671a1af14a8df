"""Which launcher starts a job's embedded engines: local processes, or Ray actors on a
cluster's nodes (`[cluster] backend`). One choice for every job that starts engines
(`libra train`'s fleet, the engines `libra rollout` and `libra serve-rollout` launch)."""

from __future__ import annotations

from libra.cluster.config import ClusterSection
from libra.cluster.engines import EmbeddedLauncher, EngineLauncher


def embedded(section: ClusterSection, local: EmbeddedLauncher) -> EngineLauncher:
    """`local` itself, or (`backend = "ray"`) `local` run inside Ray actors; joins the
    Ray cluster then (a missing `ray` or no cluster at `address` stops here, in one
    line)."""
    if section.backend == "local":
        return local
    from libra.cluster.raylaunch import RayLauncher, connect

    connect(section)
    return RayLauncher(local, section)


__all__ = ["embedded"]
