"""Collective communication times (alpha-beta model over the profile's links).

Ring algorithms: an all-reduce moves 2(g-1)/g of the message through each device, an
all-gather or reduce-scatter (g-1)/g, an all-to-all (g-1)/g. Each call also pays a fixed
latency, which dominates the small all-reduces of a decode step. A group that does not fit
in one node runs at the network rate (hierarchical algorithms do better on the
intra-node part; the network is the bottleneck either way).
"""

from __future__ import annotations

from libra.planner.profiles import HardwareProfile


def spans_nodes(hw: HardwareProfile, group: int, stride: int = 1) -> bool:
    """Whether a group of `group` devices placed `stride` apart leaves one node."""
    return group * stride > hw.devices_per_node


def allreduce_time(hw: HardwareProfile, nbytes: float, group: int, *, stride: int = 1) -> float:
    """Seconds for one all-reduce of `nbytes` over `group` devices (0 for a group of 1)."""
    if group <= 1:
        return 0.0
    bw = hw.group_bandwidth(group, spans_nodes=spans_nodes(hw, group, stride))
    return hw.eff.allreduce_latency_s + 2.0 * (group - 1) / group * nbytes / bw


def allgather_time(hw: HardwareProfile, nbytes: float, group: int, *, stride: int = 1) -> float:
    """Seconds for an all-gather (or reduce-scatter) whose *full* result is `nbytes`."""
    if group <= 1:
        return 0.0
    bw = hw.group_bandwidth(group, spans_nodes=spans_nodes(hw, group, stride))
    return hw.eff.allreduce_latency_s + (group - 1) / group * nbytes / bw


def alltoall_time(hw: HardwareProfile, nbytes: float, group: int, *, stride: int = 1) -> float:
    """Seconds for an all-to-all where each device sends `nbytes` in total."""
    if group <= 1:
        return 0.0
    bw = hw.group_bandwidth(group, spans_nodes=spans_nodes(hw, group, stride))
    return hw.eff.allreduce_latency_s + (group - 1) / group * nbytes / bw


def p2p_time(hw: HardwareProfile, nbytes: float, *, across_nodes: bool) -> float:
    """Seconds for one point-to-point transfer of `nbytes`."""
    if across_nodes:
        bw = hw.inter_node_bandwidth
    elif hw.intra_node_topology == "mesh" and hw.devices_per_node > 1:
        bw = hw.intra_node_bandwidth / (hw.devices_per_node - 1)  # one direct link
    else:
        bw = hw.intra_node_bandwidth
    return hw.eff.p2p_latency_s + nbytes / (bw * hw.eff.comm)


__all__ = ["allgather_time", "allreduce_time", "alltoall_time", "p2p_time", "spans_nodes"]
