"""`libra serve-rollout`: a standalone rollout fleet behind an HTTP API (DESIGN.md).

    config.py   ServiceConfig (TOML + flags), the submit / weights request bodies
    fair.py     FairQueue: fair admission across batches (pure)
    spool.py    the durable spool: per-batch JSONL, fsync policy, crash recovery
    batch.py    one submitted batch
    manager.py  BatchManager: submit, admission under one concurrency bound, cancel,
                recovery after a restart
    stream.py   NDJSON chunks from a cursor (per episode or per GRPO group)
    weights.py  POST /v1/weights across the endpoint pool
    metrics.py  Prometheus text
    app.py      the aiohttp routes, token check, validation
    server.py   serve(config): the whole process

The Python client is `libra.client`.
"""

from libra.service.config import ServiceConfig
from libra.service.server import serve

__all__ = ["ServiceConfig", "serve"]
