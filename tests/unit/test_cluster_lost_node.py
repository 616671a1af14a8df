"""A remote engine is taken as lost with its node only when both its host (the Ray actor
that runs it) and the engine itself stop answering (`libra.cluster.engines.check_node`):
a host merely slow to answer a poll, or an engine that still serves, is left alone.
The host is played by a stand-in (Ray lies outside what this test checks); the engine's
`/health` is a real HTTP server on loopback, or a port nothing listens on."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from libra.cluster.engines import LOST, SILENT_S, Engine, RemoteProcess, check_node
from libra.cluster.placement import Slot
from libra.cluster.process import free_port


@dataclass
class Host:
    """A remote engine whose host has left its latest poll unanswered for `silent`."""

    url: str
    silent: float
    name: str = "engine rollout0"
    start_s: float = 1.0
    log_path: Path = Path("/nonexistent/engine-rollout0.log")
    code: int | None = None
    why: str = ""

    @property
    def returncode(self) -> int | None:
        return self.code

    def last_error(self) -> str:
        return self.why

    async def stop(self, grace_s: float) -> None:
        return None

    def kill(self) -> None:
        return None

    def silent_s(self) -> float:
        return self.silent

    def lose(self, why: str) -> None:
        self.code, self.why = LOST, why


@pytest.fixture
def serving() -> Iterator[str]:
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            return None

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def engine(host: Host) -> Engine:
    assert isinstance(host, RemoteProcess)
    return Engine("rollout0", "embedded", host, Slot("node-7", "cpu"))


async def test_a_silent_host_with_a_dead_engine_is_lost_with_its_node() -> None:
    host = Host(f"http://127.0.0.1:{free_port()}", silent=SILENT_S + 1)
    assert await check_node(engine(host)) == LOST
    assert host.returncode == LOST
    assert "node-7 does not answer" in host.last_error()
    assert f"{host.url}/health" in host.last_error()


async def test_an_engine_that_serves_is_not_lost_while_its_host_is_slow(serving: str) -> None:
    host = Host(serving, silent=SILENT_S * 10)
    assert await check_node(engine(host)) is None
    assert host.returncode is None


async def test_a_host_that_answered_recently_is_not_second_guessed() -> None:
    host = Host(f"http://127.0.0.1:{free_port()}", silent=SILENT_S / 2)
    assert await check_node(engine(host)) is None
    assert host.returncode is None
