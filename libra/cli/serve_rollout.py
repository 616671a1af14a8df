"""`libra serve-rollout [CONFIG] [flags]`: a standalone rollout fleet behind an HTTP API;
trajectories stream to any trainer (see README "libra serve-rollout" and docs/service.md)."""

from __future__ import annotations

import argparse
import logging
import sys

from libra.cli.common import (
    add_fleet_flags,
    add_ray_flag,
    add_set_flag,
    apply_bucket_flags,
    config_of,
    fleet_overrides,
    overrides,
    ray_overrides,
)

EPILOG = """\
examples:
  libra serve-rollout examples/serve-rollout.toml
  libra serve-rollout --endpoint tp1=http://127.0.0.1:8000 --endpoint tp1=http://127.0.0.1:8001
  LIBRA_TOKEN=s3cret libra serve-rollout --host 0.0.0.0 --port 8700 \\
      --env arith --env adder=my_envs.py:Adder --endpoint tp1=http://10.0.0.5:8000

The URL it listens on is printed on stdout once it accepts connections. Without a token
it binds to loopback only. Records are spooled under --spool (default runs/spool) before
they are streamed; restarting with the same spool resumes unfinished batches.
"""


def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(
        name,
        help="serve rollouts over HTTP: submit batches, stream trajectories",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", help="TOML config (flags override its keys)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1; others need a token)")
    p.add_argument("--port", type=int, help="TCP port (default 8700; 0 = any free port)")
    p.add_argument(
        "--token",
        help="bearer token for every call but /healthz; prefer $LIBRA_TOKEN, since a "
        "command line is visible to every user of the machine (ps)",
    )
    p.add_argument(
        "--env",
        action="append",
        metavar="[NAME=]SPEC",
        help="host an env: a registered id or file.py:Class (repeatable; default: every "
        "registered env)",
    )
    p.add_argument("--concurrency", type=int, help="episodes in flight across all batches")
    p.add_argument("--workers", type=int, metavar="N",
                   help="processes that run episodes, each with its own event loop, behind "
                   "the one API and spool (default 1: this process)")  # fmt: skip
    add_fleet_flags(p)
    add_ray_flag(p)
    add_set_flag(p, "--set max_batch_weight=4 --set launch.vllm.gpus=[0,1]")
    p.add_argument("--endpoint-kind", choices=["auto", "embedded", "vllm"],
                   help="how POST /v1/weights loads checkpoints (default auto)")  # fmt: skip
    p.add_argument("--weights-dir", action="append", metavar="DIR",
                   help="a folder POST /v1/weights may load from (repeatable; needed when "
                   "the service is reachable from other hosts)")  # fmt: skip
    p.add_argument("--spool", metavar="DIR", help="spool folder (default runs/spool)")
    p.add_argument("--fsync", choices=["always", "interval", "never"],
                   help="spool fsync policy (default always; see docs/service.md)")  # fmt: skip
    p.add_argument("--on-restart", choices=["rerun", "abort"],
                   help="unfinished episodes after a restart (default rerun)")  # fmt: skip
    return p


def run(args: argparse.Namespace) -> int:
    from libra import config as cfgmod
    from libra.rollout.run import run_sync
    from libra.service.config import EnvEntry, ServiceConfig, absolute_dirs
    from libra.service.server import announce, serve, token_from_env

    logging.basicConfig(level=logging.WARNING, format="libra: %(message)s", stream=sys.stderr)
    flags = {
        "host": args.host,
        "port": args.port,
        "concurrency": args.concurrency,
        "workers": args.workers,
        "endpoint_kind": args.endpoint_kind,
        "spool.dir": args.spool,
        "spool.fsync": args.fsync,
        "spool.on_restart": args.on_restart,
        **fleet_overrides(args),
        **ray_overrides(args),
    }
    with config_of("serve-rollout", args.config):
        cfg = cfgmod.load(ServiceConfig, args.config, overrides(args.set, flags))
    cfg.token = token_from_env(args.token or cfg.token)
    if args.env:
        entries = []
        for item in args.env:
            name, sep, spec = item.partition("=")
            entries.append(EnvEntry(spec=spec, name=name) if sep else EnvEntry(spec=item))
        cfg.envs = [*cfg.envs, *entries]
    if args.weights_dir:
        cfg.weights_dirs = [*cfg.weights_dirs, *absolute_dirs(args.weights_dir)]
    apply_bucket_flags(cfg, args)
    run_sync(serve(cfg, ready=announce))
    return 0
