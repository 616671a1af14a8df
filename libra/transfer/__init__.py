"""The tensor half of weight broadcast: trainer rank 0 sends, every serving worker
receives, over one gloo process group per server (torch only; no Libra imports).

    pg = wire.open_group("127.0.0.1", port, rank=0, world=1 + tp, timeout_s=120)
    wire.send(pg, named_tensors, bucket_bytes)          # trainer rank 0
    for name, t in wire.receive(pg, metas, bucket_bytes): ...   # each worker rank

Who imports it: the trainer's rank process (`libra.trainer.worker`), the embedded
engine (`libra.engine.server`), and vLLM's workers through `libra.transfer.vllm`, the
weight-transfer engine Libra registers in vLLM (`--weight-transfer-config
'{"backend": "libra_gloo"}'`). The HTTP side (pause, the four phases, versions) is
`libra.weights.broadcast`'s.
"""
