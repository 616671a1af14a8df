"""The one owner of the trainer's device, collective backend and mesh.

Every trainer process (a rank of `ElasticTrainer`, a scenario member, the warm start)
resolves a `Device` from its config and takes everything device-shaped from here: its
process setup, the replica's own process group, the replica's mesh and FSDP sharding,
the per-epoch cross-replica groups, where the replica's small collectives put their
tensors, and the autocast context. No other trainer module names a device type or a
backend (torchtitan's `distributed/parallel_dims.py` and
`distributed/utils.py::init_distributed` have the same job).

`trainer.device` chooses (`resolve_type`): `cpu` is gloo everywhere; `cuda` is one GPU
per rank (`WorkerSpec.gpu`, dealt by the rank starter), the model, gradients and Adam
state on it, and the replica's own group (FSDP2's all-gathers and reduce-scatters, the
small sums) over NCCL. The cross-replica elastic domain stays gloo over host buffers on
either device: its membership changes per epoch and a member that hangs must cost the
core at most `elastic.timeout_s` then be dropped, which gloo's per-collective timeout
gives and which this project has tested; an NCCL domain would need its communicators
aborted on a hang (`docs/elastic.md`, "On GPUs", says what only a multi-GPU node can
prove).
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


_TorchDevice = torch.device


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

    @property
    def comm(self) -> _TorchDevice:
        """Where tensors of the replica's own collectives live (NCCL takes CUDA tensors
        only; gloo here takes host ones)."""
        return self.torch if self.backend == "nccl" else torch.device("cpu")

    @classmethod
    def resolve(cls, cfg: TrainerConfig, gpu: int | None = None) -> Device:
        """The device of one process of a run: `cfg.device` (`resolve_type`), and on
        CUDA the ordinal `gpu` its starter gave it (None: the first visible one, as in
        a Ray actor that sees only its own GPU)."""
        if resolve_type(cfg.device) == "cpu":
            return CPU
        return cuda(gpu or 0)


CPU = Device(type="cpu", backend="gloo", threads=1)
"""CPU compute, gloo collectives: the default of the loss functions when a caller (a
test, a tool) has no config."""


def resolve_type(device: str, cuda_here: bool | None = None) -> Literal["cpu", "cuda"]:
    """`trainer.device` as a device type: `auto` is `cuda` when there are GPUs
    (`cuda_here`; None: whether torch sees one in this process); `cuda` where there are
    none is a `ConfigError` naming the fix."""
    from libra.errors import ConfigError

    here = torch.cuda.is_available() if cuda_here is None else cuda_here
    if device == "auto":
        return "cuda" if here else "cpu"
    if device == "cuda" and not here:
        build = torch.__version__
        raise ConfigError(
            f"trainer.device = 'cuda': no CUDA GPU is visible to torch {build} here "
            "(a CPU build, no driver, or CUDA_VISIBLE_DEVICES empty); set "
            "trainer.device = 'cpu' or 'auto', or run where the GPUs are"
        )
    return "cuda" if device == "cuda" else "cpu"


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
    "resolve_type",
]
