"""`libra serve-engine [--model DIR] [--port P] [--host H]`: the embedded inference server."""

from __future__ import annotations

import argparse

from libra.cli.common import progress, seed
from libra.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(
        name,
        help="serve a model folder over an OpenAI-compatible API (embedded CPU engine)",
        description=(
            "The embedded PyTorch inference server: continuous batching with a KV cache, "
            "vLLM-format /v1/completions and /v1/chat/completions (Hermes tool calls), "
            '/v1/models, /health, and POST /v1/load_weights {"path": DIR}. Without --model it '
            "serves the tiny default model, made on first use in the user cache."
        ),
    )
    p.add_argument("--model", metavar="DIR", help="model folder (default: the tiny default model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free)")
    p.add_argument("--served-model-name", help="model name in the API (default: the --model path)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most sequences per batch (64)")
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV cache budget in GiB (2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--seed", type=seed, help="seed of the sampler for requests without a seed")
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="compute dtype (auto: the checkpoint's; bfloat16 is ~2x faster on AMX/AVX512-BF16)",
    )
    return p


def run(args: argparse.Namespace) -> int:
    import asyncio

    from libra.engine.model_maker import ensure_default_model
    from libra.engine.server import EmbeddedEngine, serve

    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port {args.port}: expected 0..65535")
    if args.max_num_seqs < 1 or args.threads < 1 or not 0 < args.kv_cache_gib < 1 << 20:
        raise ConfigError(
            "--max-num-seqs and --threads must be >= 1, --kv-cache-gib a number of GiB > 0"
        )
    model = args.model or str(ensure_default_model())
    engine = EmbeddedEngine(
        model,
        served_model_name=args.served_model_name,
        max_num_seqs=args.max_num_seqs,
        kv_cache_gib=args.kv_cache_gib,
        threads=args.threads,
        seed=args.seed,
        dtype=args.dtype,
    )

    def ready(port: int) -> None:
        progress(f"libra serve-engine: serving {engine.name} on http://{args.host}:{port}")

    try:
        asyncio.run(serve(engine, args.host, args.port, ready))
    except OSError as e:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    return 0
