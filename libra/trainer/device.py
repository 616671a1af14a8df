"""The one owner of the trainer's device, collective backend and mesh.

Every trainer process (a rank of `ElasticTrainer`, a scenario member, the warm start)
resolves a `Device` from its config and takes everything device-shaped from here: its
process setup, the replica's own process group, the replica's mesh and FSDP sharding,
the per-epoch cross-replica groups and the autocast context. No other trainer module
names a device type or a backend (torchtitan's `distributed/parallel_dims.py` and
`distributed/utils.py::init_distributed` have the same job).

Every rank `libra train` and `ElasticTrainer` spawn computes on CPU and talks over gloo
(`Device.resolve`). `cuda()` is one CUDA device with NCCL collectives: a replica built on
it holds its model, gradients and Adam state on the GPU and the loss moves each
micro-batch there (`scripts/gpu-check.sh` runs one such rank). Spawned ranks are not
placed on GPUs yet (the cross-replica groups, snapshots and weight broadcasts are gloo
over CPU tensors), so no config chooses it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from torch.distributed import Store
    from torch.distributed.device_mesh import DeviceMesh

    from libra.trainer.config import TrainerConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    """Where one trainer process computes and how its collectives travel."""

    type: Literal["cpu", "cuda"]
    """torch device type of the model, its gradients and the optimizer state."""
    backend: Literal["gloo", "nccl"]
    """Collective backend of the replica's own group and of the cross-replica groups."""
    threads: int
    """torch intra-op threads per process. The ranks of a run share the machine's
    cores: one thread each (the warm start measured 2 threads on 2 busy cores at 2-8x
    the CPU time of one)."""
    index: int = 0
    """The CUDA device ordinal of this process (unused on CPU)."""

    @property
    def torch(self) -> torch.device:
        """The `torch.device` tensors of this process live on."""
        return torch.device("cuda", self.index) if self.type == "cuda" else torch.device("cpu")

    @classmethod
    def resolve(cls, cfg: TrainerConfig) -> Device:
        """The device a trainer config asks for (every process of a run resolves the
        same one from the same config)."""
        del cfg  # nothing in the config chooses a device yet: every run is CPU / gloo
        return CPU


CPU = Device(type="cpu", backend="gloo", threads=1)
"""CPU compute, gloo collectives: what every trainer config resolves to today, and the
default of the loss functions when a caller (a test, a tool) has no config."""


def cuda(index: int = 0, threads: int = 1) -> Device:
    """CUDA device `index`, NCCL collectives (see the module doc for what runs on it)."""
    return Device(type="cuda", backend="nccl", threads=threads, index=index)


def init_process(device: Device) -> None:
    """Per-process setup, first thing in a spawned trainer process."""
    torch.set_num_threads(device.threads)
    if device.type == "cuda":
        torch.cuda.set_device(device.index)
    if device.backend == "gloo":
        # The replica's own group picks its network interface from this variable
        # (loopback on one machine); the cross-replica groups name their host instead.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def init_replica_group(
    device: Device, store: Store, rank: int, size: int, timeout_s: float
) -> None:
    """The replica's own process group (this process's default group): FSDP's
    collectives and the small intra-replica all-reduces run on it. Built once and never
    rebuilt; blocks until all `size` ranks of the replica join."""
    import torch.distributed as dist

    dist.init_process_group(
        device.backend, store=store, rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )  # fmt: skip


def replica_mesh(device: Device, size: int) -> DeviceMesh:
    """A 1-D mesh over the replica's `size` ranks (its default group)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (size,))


def parallelize(model: torch.nn.Module, mesh: DeviceMesh, cfg: TrainerConfig) -> None:
    """Shard `model` over the replica's mesh: FSDP2 `fully_shard` on each decoder layer,
    then on the root, with plain-sum gradient reductions. `cfg.dtype = "bfloat16"` is
    FSDP2's mixed precision: parameters all-gathered and computed in bfloat16, gradients
    reduce-scattered in float32 into the float32 shards (master weights, gradients and
    Adam state stay float32, as in the unsharded path's autocast)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()  # float32 throughout
    if cfg.dtype == "bfloat16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    units = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    for m in units:
        fully_shard(m, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for m in [*units, model]:
        # Sum (not average) inside the replica: the elastic layer divides by the global
        # token count once. Gloo has no PREMUL_SUM, so force plain SUM collectives.
        m.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        m.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]


def cross_replica_group(
    device: Device, store: Store, prefix: str, rank: int, size: int, *, timeout_s: float,
    host: str,
) -> Any:  # fmt: skip
    """One epoch's group of shard j across replicas, over `PrefixStore(prefix, store)`;
    blocks until all `size` members join. Constructed directly rather than with
    `new_group`, which cannot include a process outside the original world (see
    `libra.trainer.rendezvous`). `timeout_s` bounds every collective on it (gloo cannot
    abort one); `host` is the address its sockets bind to."""
    from torch.distributed import PrefixStore, ProcessGroupGloo

    opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
    return ProcessGroupGloo(PrefixStore(prefix, store), rank, size, opts)


def autocast(device: Device, dtype: str) -> contextlib.AbstractContextManager:
    """The forward pass's autocast: `bfloat16` on the device, nothing for `float32`
    (master weights, gradients and Adam state stay float32 either way)."""
    if dtype == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


__all__ = [
    "CPU",
    "Device",
    "autocast",
    "cross_replica_group",
    "cuda",
    "init_process",
    "init_replica_group",
    "parallelize",
    "replica_mesh",
]
