"""`libra profile`: measure endpoints and a trainer micro-step, write a hardware profile
that `libra plan`, `libra simulate` and `libra train` use instead of datasheet figures."""

from __future__ import annotations

import argparse

from libra.cli.common import (
    add_json_flag,
    int_list,
    output_file,
    parse_pairs,
    print_json,
    progress,
)
from libra.errors import ConfigError

EPILOG = """\
examples:
  libra profile --endpoint tp1=http://127.0.0.1:8000 --out local.toml
  libra profile --base h100-80g --endpoint tp1=http://node1:8000 \\
      --endpoint tp4=http://node1:8001 --out h100-measured.toml
  libra plan --gpus 16 --hardware h100-measured.toml --model ./my-model

Each endpoint is timed through /v1/completions (decode steps over --batch x --context,
prefill steps over --context), plus a forward + backward of the model folder on this
machine when it is here. The fit sets the cost model's effective bandwidth, FLOP/s and
step overhead (docs/cost-model.md, "Measured profiles"); one point off the grid is
measured but not fitted, and the report gives the prediction's error on it.
"""


def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(
        name,
        help="measure endpoints (decode, prefill) and a trainer step; write a hardware profile",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--endpoint", action="append", metavar="BUCKET=URL", help="an endpoint to time (repeatable)"
    )
    p.add_argument(
        "--bucket",
        action="append",
        metavar="NAME=TP:BOUND",
        help="a bucket's TP size (default: buckets named tpN have TP N, others TP 1)",
    )
    p.add_argument(
        "--kind",
        choices=("auto", "embedded", "vllm"),
        default="auto",
        help="what serves the endpoints (default: read from /v1/models)",
    )
    p.add_argument(
        "--model",
        help="the served model: a folder with config.json or a known id (default: the folder "
        "the endpoints report, when it is on this machine)",
    )
    p.add_argument(
        "--base",
        default="local",
        help="profile the unmeasured figures (memory, links, peaks) come from: a built-in id "
        "(h100-80g, ...), a .toml, or local (this machine, calibrated now; default)",
    )
    p.add_argument("--devices", type=int, help="--base local: devices this machine counts as")
    p.add_argument("--batch", default="1,4,16", help="decode batch sizes (default 1,4,16)")
    p.add_argument(
        "--context", default="128,512,2048", help="prompt lengths in tokens (default 128,512,2048)"
    )
    p.add_argument(
        "--decode-tokens", type=int, default=32, help="tokens per decode timing (default 32)"
    )
    p.add_argument("--repeats", type=int, default=10, help="rounds over the grid (default 10)")
    p.add_argument(
        "--held-out",
        metavar="BATCH:CONTEXT",
        help="the point measured but not fitted (default: between the two largest of each)",
    )
    p.add_argument(
        "--no-train-step", action="store_true", help="skip the trainer micro-step (train_mfu)"
    )
    p.add_argument(
        "--train-lengths", default="256,1024", help="micro-step sequence lengths (default 256,1024)"
    )
    p.add_argument("--id", help="profile id (default: BASE-profiled)")
    p.add_argument("--out", default="profile.toml", help="profile file (default profile.toml)")
    add_json_flag(p)
    return p


def run(args: argparse.Namespace) -> int:
    from libra import config as cfgmod
    from libra.profiling.config import ProfileConfig
    from libra.profiling.report import document, render, write
    from libra.profiling.session import run_profile
    from libra.rollout.serving import merge_bucket_flags

    endpoint_flags = parse_pairs(args.endpoint, "--endpoint", "BUCKET=URL")
    if not endpoint_flags:
        raise ConfigError("no endpoint: pass --endpoint BUCKET=URL (repeatable)")
    buckets = merge_bucket_flags(
        [], endpoint_flags, parse_pairs(args.bucket, "--bucket", "NAME=TP:BOUND")
    )
    endpoints = [{"bucket": b.name, "url": url, "tp": b.tp} for b in buckets for url in b.endpoints]
    held = None
    if args.held_out:
        held = int_list(args.held_out.replace(":", ","), "--held-out")
        if len(held) != 2:
            raise ConfigError(f"--held-out {args.held_out!r}: expected BATCH:CONTEXT, e.g. 8:1024")
    data = {
        "endpoints": endpoints,
        "kind": args.kind,
        "model": args.model,
        "base": args.base,
        "devices": args.devices,
        "batches": int_list(args.batch, "--batch"),
        "contexts": int_list(args.context, "--context"),
        "decode_tokens": args.decode_tokens,
        "repeats": args.repeats,
        "held_out": held,
        "train_step": not args.no_train_step,
        "train_lengths": int_list(args.train_lengths, "--train-lengths"),
        "id": args.id,
    }
    cfg = cfgmod.build(ProfileConfig, {k: v for k, v in data.items() if v is not None}, "flags")
    out = output_file(args.out, "--out")  # before minutes of measuring, not after
    result = run_profile(cfg, progress=progress)
    doc = document(result)
    try:
        write(result, out)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write the profile ({e.strerror or e})") from None
    if args.json:
        print_json({"out": str(out), **doc})
    else:
        print(render(result, doc, out))
    return 0
