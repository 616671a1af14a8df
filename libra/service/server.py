"""`serve(config)`: the whole `libra serve-rollout` process.

Start-up order: model and tokenizer, envs (configured ones load now), buckets and the
endpoint pool (embedded engines launched when a bucket asks), the spool (unfinished
batches resume), then the HTTP listener. Shut-down (SIGINT / SIGTERM) in reverse: the
listener first (open streams are cut, so clients reconnect instead of taking them for
complete), then running episodes (not recorded; a restart runs them again), the spool
(fsynced), the pool and launched engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import resource
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from libra.auth import is_loopback
from libra.endpoints.pool import EndpointPool
from libra.errors import ConfigError
from libra.rollout.serving import Serving, open_pool, resolve_serving
from libra.rollout.supervise import EngineWatch
from libra.rollout.worker import HostedEnv, WorkerInit
from libra.rollout.workers import WorkerPool, split_limits, worker_buckets
from libra.service.app import build_app
from libra.service.config import ServiceConfig
from libra.service.envs import EnvHost
from libra.service.errors import RequestError
from libra.service.manager import BatchManager
from libra.service.weights import update_all, weights_folder

log = logging.getLogger("libra.service")


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not listening yet."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port}: {e.strerror or e}; "
            "pick another --port (0 = any free one) or --host"
        ) from None
    return sock


IDLE_S = 15.0
"""A connection that has not sent a whole request in this long is closed (aiohttp's
keep-alive timer, 75 s by default: a client sending headers that never end held its
connection that long, and 10,000 of them took every file descriptor)."""


class _ClientFaults(logging.Filter):
    """Drops aiohttp's "Error handling request" tracebacks for what a client did wrong or
    stopped doing (a malformed request line or header, a body cut short): each was ~30
    lines in the log, sent before any token is checked, so anyone could flood it. They
    are answered 400 as before; the service's own errors are logged as they were."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, HttpProcessingError | ConnectionResetError)


def quiet_client_faults() -> None:
    """Install `_ClientFaults` on aiohttp's server logger (once)."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _ClientFaults) for f in logger.filters):
        logger.addFilter(_ClientFaults())


def max_connections() -> int:
    """Connections served at once: half the open-file limit, at most 4,096 (the rest is
    for the spool, the engines and the workers)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, min(4096, soft // 2))


def cap_connections(server: Any, limit: int) -> None:
    """Close a new connection at once while `limit` are open, so that a flood of them
    costs the process no file descriptor it needs (the service answered nothing, not
    even /healthz, once they were all taken)."""
    accept = server.connection_made
    said = [-math.inf]

    def capped(handler: Any, transport: Any) -> None:
        accept(handler, transport)
        if len(server.connections) > limit:
            if time.monotonic() - said[0] > 60:  # once a minute, not once per connection
                said[0] = time.monotonic()
                log.warning("%d connections open, the most this service serves; new ones "
                            "are closed until some end", limit)  # fmt: skip
            # Closed once the handler's task has started: closed here, the connection
            # was lost before the task ran, which then failed on an assertion and left
            # a traceback in the log for every connection refused.
            loop = asyncio.get_running_loop()
            loop.call_soon(loop.call_soon, transport.close)

    server.connection_made = capped


def check_exposure(config: ServiceConfig) -> None:
    if not config.token and not is_loopback(config.host):
        raise ConfigError(
            f"refusing to listen on {config.host} without a token: anyone who can reach it "
            "could run episodes; pass --token (or set LIBRA_TOKEN), or bind 127.0.0.1"
        )


async def serve(
    config: ServiceConfig,
    *,
    ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run the service until SIGINT/SIGTERM (or `stop` is set). `ready(url)` is called
    once the listener accepts connections."""
    check_exposure(config)
    # Bind first: a taken port fails at once (not after engines started), and engines
    # launched below cannot be handed the same port. Connections wait until we listen.
    sock = bind(config.host, config.port)
    try:
        await _serve(config, sock, ready, stop)
    finally:
        sock.close()


async def _serve(
    config: ServiceConfig,
    sock: socket.socket,
    ready: Callable[[str], None] | None,
    stop: asyncio.Event | None,
) -> None:
    serving = resolve_serving(config.model, config.limits.max_context, config.buckets)
    envs = EnvHost(config.envs, serving.buckets, config.policy, config.routing)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    watch = EngineWatch(check_local=config.check_weights_locally)
    async with contextlib.AsyncExitStack() as stack:
        pool = await stack.enter_async_context(
            open_pool(
                serving, config.endpoint, cluster=config.cluster, launch=config.launch, watch=watch
            )
        )
        manager = BatchManager(
            config=config,
            pool=pool,
            tokenizer=serving.tokenizer,
            max_context=serving.max_context,
            envs=envs,
        )
        manager.recover(kept_urls=serving.configured_urls)
        await reload_launched(manager, pool, serving, config, watch)
        if config.workers > 1:  # after recover: a worker starts with the weight versions
            manager.workers = await stack.enter_async_context(
                WorkerPool(config.workers, lambda: worker_init(config, serving, envs, pool))
            )
        # Short shutdown timeout: open streams wait on the spool and would hold a stop up.
        app = build_app(manager, pool, config, watch)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0,
                               keepalive_timeout=IDLE_S)  # fmt: skip
        await runner.setup()
        cap_connections(runner.server, max_connections())
        quiet_client_faults()
        try:
            await web.SockSite(runner, sock).start()
            host, port = sock.getsockname()[:2]
            url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
            if ready is not None:
                ready(url)
            async with asyncio.TaskGroup() as tg:
                work = tg.create_task(manager.run(), name="libra-batches")
                await stop.wait()
                await runner.cleanup()  # no new requests; open streams are cut
                running = manager.fair.running()
                if manager.workers is not None:
                    manager.workers.begin_close()
                work.cancel()
            print(
                f"libra serve-rollout: stopped; {running} running episodes were interrupted "
                "(a restart on the same spool runs them again)",
                file=sys.stderr, flush=True,
            )  # fmt: skip
        finally:
            await runner.cleanup()


async def reload_launched(
    manager: BatchManager,
    pool: EndpointPool,
    serving: Serving,
    config: ServiceConfig,
    watch: EngineWatch,
) -> None:
    """After a restart: load the last weight update into the engines this service
    launched, when it came from a folder (they start on the base model; those given by
    URL kept theirs). One line on stderr either way; a load that fails leaves them at
    version 0, as a broadcast update does (only the trainer holds those tensors)."""
    launched = [e.url for e in pool.endpoints() if e.url not in serving.configured_urls]
    if not launched or (manager.folder is None and not manager.version):
        return
    if manager.folder is None:
        print(f"libra serve-rollout: the launched engines serve the base model (version 0): "
              f"version {manager.version} came by broadcast; send it again",
              file=sys.stderr, flush=True)  # fmt: skip
        return
    try:  # the folder passed this check when it was posted; the config may have changed
        folder = await asyncio.to_thread(
            weights_folder, manager.folder, config.weights_dirs,
            exposed=not is_loopback(config.host), local=config.check_weights_locally,
        )  # fmt: skip
    except RequestError as e:
        print(f"libra serve-rollout: the launched engines serve the base model (version 0): "
              f"the last update's folder is refused now ({e})",
              file=sys.stderr, flush=True)  # fmt: skip
        return
    async with watch.lock:
        results = await update_all(pool, config.endpoint_kind, manager.version, folder,
                                   check_local=config.check_weights_locally,
                                   only=launched)  # fmt: skip
        ok = [u for u, r in results.items() if r["status"] == "ok"]
        await watch.loaded(pool, ok, manager.version, folder)
    bad = {u: r.get("error") for u, r in results.items() if r["status"] != "ok"}
    print(f"libra serve-rollout: version {manager.version} from {folder} loaded "
          f"into {len(ok)} of {len(launched)} launched engines"
          + (f"; the others serve the base model (version 0): {bad}" if bad else ""),
          file=sys.stderr, flush=True)  # fmt: skip


def worker_init(
    config: ServiceConfig, serving: Serving, envs: EnvHost, pool: EndpointPool
) -> WorkerInit:
    """What a rollout worker of this service starts with (`--workers N`): every endpoint
    of the pool (launched engines included) at its weight version now, its share of the
    endpoint limits, the hosted envs."""
    return WorkerInit(
        model=str(serving.model_dir),
        max_context=serving.max_context,
        buckets=worker_buckets(pool),
        endpoint=split_limits(config.endpoint, config.workers),
        limits=config.limits,
        envs=[HostedEnv(name=e.key, spec=e.spec, options=e.options) for e in envs.entries()],
        policy=config.policy,
        routing=config.routing,
        versions={e.url: e.version for e in pool.endpoints()},
        paused=[e.url for e in pool.endpoints() if not e.admitting],
    )


def announce(url: str) -> None:
    """One line on stderr (and the URL alone on stdout, for scripts)."""
    print(f"libra serve-rollout: listening on {url}", file=sys.stderr, flush=True)
    print(url, flush=True)


def token_from_env(flag: str | None) -> str | None:
    return flag or os.environ.get("LIBRA_TOKEN") or None


__all__ = ["announce", "check_exposure", "is_loopback", "serve", "token_from_env"]
