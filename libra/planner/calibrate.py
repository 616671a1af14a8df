"""The `local` hardware profile: this machine, measured with torch.

A "device" is one worker process (of `threads_per_device` cores); `libra train` on CPU
runs its rollout engines and trainer replicas as such processes. Measured:

- `bf16_tflops` slot (the compute peak): the best FLOP/s of a large square matmul in the
  trainer's dtype on one device's threads;
- train and inference efficiency: FLOP/s of a SwiGLU MLP block of the model's width,
  forward + backward (train) and forward only (inference), over that peak;
- memory bandwidth: a large tensor copy (read + write) on one device's threads, capped at
  the whole machine's copy rate shared by all devices;
- memory: physical RAM shared by the devices.

Workers that share cores: with more devices x threads than the machine has cores (the
CPU default runs 3 workers on 2 cores), a device gets its share of the cores, not a
whole one: the compute peak is scaled by cores / (devices x threads) (capped at 1; the
copy rate is already shared as above). The ranking of assignments still comes from the
model; `libra train` corrects each one by what it measured (`libra.planner.measured`).

Collectives between processes go through shared memory, so their bandwidth is taken as
half the copy rate, with a fixed latency (gloo on loopback) that is an assumption. This
function is the planner's one deliberate use of the clock; everything else is pure.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from libra.planner.profiles import Efficiency, HardwareProfile

_MiB = 1 << 20


def _best_rate(fn: Any, work: float, budget_s: float, clock: Callable[[], float]) -> float:
    """Best work/second over repeated calls within the budget (after one warm-up)."""
    fn()
    best = 0.0
    deadline = clock() + budget_s
    while True:
        t0 = clock()
        fn()
        dt = clock() - t0
        best = max(best, work / max(dt, 1e-9))
        if clock() > deadline:
            return best


def calibrate_local(
    *,
    devices: int | None = None,
    threads_per_device: int | None = None,
    hidden: int = 256,
    intermediate: int | None = None,
    tokens: int = 2048,
    dtype: str = "float32",
    budget_s: float = 0.3,
    step_overhead_s: float = 5e-3,
    clock: Callable[[], float] = time.perf_counter,
) -> HardwareProfile:
    """Measure this machine. `devices` defaults to the number of cores; `hidden` and
    `intermediate` should be the model's, so the efficiencies fit the work it will do.
    `step_overhead_s` is the inference engine's time per decode step outside the model
    (pass a measured value; the default is an assumption for a Python CPU engine)."""
    import torch

    cores = os.cpu_count() or 1
    devices = devices or cores
    tpd = threads_per_device or max(1, cores // devices)
    inter = intermediate or 2 * hidden
    dt = getattr(torch, dtype)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(tpd)
        with torch.no_grad():
            n = 1024
            a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
            peak = _best_rate(lambda: a @ b, 2.0 * n**3, budget_s, clock)

            x = torch.randn(tokens, hidden, dtype=dt)
            wg = torch.randn(hidden, 2 * inter, dtype=dt)
            wd = torch.randn(inter, hidden, dtype=dt)

            def mlp_fwd() -> Any:
                g, u = (x @ wg).chunk(2, dim=-1)
                return (torch.nn.functional.silu(g) * u) @ wd

            mlp_flops = 2.0 * tokens * hidden * 3 * inter
            fwd = _best_rate(mlp_fwd, mlp_flops, budget_s, clock)

        xg = x.clone().requires_grad_(True)
        wgg, wdg = wg.clone().requires_grad_(True), wd.clone().requires_grad_(True)

        def mlp_train() -> None:
            g, u = (xg @ wgg).chunk(2, dim=-1)
            ((torch.nn.functional.silu(g) * u) @ wdg).sum().backward()

        train = _best_rate(mlp_train, 3.0 * mlp_flops, budget_s, clock)

        big = torch.empty(64 * _MiB // 4, dtype=torch.float32)
        out = torch.empty_like(big)
        nbytes = 2.0 * big.numel() * 4
        bw_dev = _best_rate(lambda: out.copy_(big), nbytes, budget_s, clock)
        torch.set_num_threads(cores)
        bw_all = _best_rate(lambda: out.copy_(big), nbytes, budget_s, clock)
    finally:
        torch.set_num_threads(prev)
    bw = min(bw_dev, bw_all / devices)
    share = min(1.0, cores / (devices * tpd))  # devices that share cores get their part
    try:
        ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        ram = 8.0 * (1 << 30)
    measured = f"measured by calibrate_local on {cores} cores, {devices} devices x {tpd} threads"
    return HardwareProfile(
        id="local",
        name=f"this machine: {devices} devices of {tpd} thread(s) ({dtype})",
        memory_bytes=ram / devices,
        hbm_bandwidth=bw,
        flops=peak * share,
        intra_node_bandwidth=bw / 2,
        intra_node_topology="switch",
        inter_node_bandwidth=bw / 2,
        devices_per_node=devices,
        eff=Efficiency(
            hbm=1.0,
            comm=1.0,
            train_mfu=min(1.0, train / peak),
            prefill_mfu=min(1.0, fwd / peak),
            allreduce_latency_s=100e-6,
            p2p_latency_s=50e-6,
            step_overhead_s=step_overhead_s,
        ),
        sources={
            "bf16_tflops": f"{measured}: best {dtype} 1024^3 matmul rate x {share:.3g} "
            f"(the share of {cores} cores each of {devices} x {tpd} threads gets)",
            "hbm_tbps": f"{measured}: 64 MiB tensor copy, min(one device, machine / devices)",
            "memory_gib": "physical RAM / devices",
            "efficiency.train_mfu": f"{measured}: SwiGLU MLP ({hidden}->{inter}) fwd+bwd / peak",
            "efficiency.prefill_mfu": f"{measured}: same MLP forward rate / peak",
            "intra_node_gbps": "assumption: shared-memory collectives run at half the copy rate",
            "efficiency.allreduce_latency_us": "assumption: gloo on loopback, ~100 us",
            "efficiency.step_overhead_ms": "argument step_overhead_s (default: assumption)",
        },
    )


__all__ = ["calibrate_local"]
