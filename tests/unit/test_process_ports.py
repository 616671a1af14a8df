"""A server child whose port another process took between the check and its bind is
started again on another port (CI saw `libra train` fail at start on exactly that);
any other start failure is not retried."""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

import pytest

from libra.cluster import process
from libra.errors import EndpointError

SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_child_that_loses_its_port_is_started_again_on_another(tmp_path: Path) -> None:
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    ports: list[int] = []

    def start(port: int) -> process.Child:
        # the first start binds the port someone else holds, as a race would leave it
        ports.append(taken if not ports else port)
        return process.spawn(
            "server",
            [sys.executable, "-c", SERVER, str(ports[-1])],
            log_path=tmp_path / "server.log",
            url=f"http://127.0.0.1:{ports[-1]}",
        )

    async def main() -> process.Child:
        return await process.spawn_listening(start, 30)

    try:
        child = asyncio.run(main())
        try:
            assert len(ports) == 2 and ports[1] != taken
            assert child.url.endswith(f":{ports[1]}") and process.healthy(child.url)
            # the failed start's output is in the log, not in this run's tail
            assert "Address already in use" in (tmp_path / "server.log").read_text()
            assert "in use" not in child.log_tail()
        finally:
            process.kill(child)
    finally:
        squatter.close()


def test_a_child_that_fails_otherwise_is_not_retried(tmp_path: Path) -> None:
    starts: list[int] = []

    def start(port: int) -> process.Child:
        starts.append(port)
        return process.spawn(
            "broken",
            [sys.executable, "-c", "raise SystemExit('no model here')"],
            log_path=tmp_path / "broken.log",
            url=f"http://127.0.0.1:{port}",
        )

    with pytest.raises(EndpointError, match="no model here"):
        asyncio.run(process.spawn_listening(start, 30))
    assert len(starts) == 1


def test_free_ports_come_from_below_the_ephemeral_range() -> None:
    low = process._ephemeral_low()
    ports = {process.free_port() for _ in range(20)}
    if low > 21000:
        assert all(20000 <= p < low for p in ports)
    assert len(ports) > 1


def test_a_port_another_process_answers_is_never_taken_for_the_childs(tmp_path: Path) -> None:
    """Another local user who binds the child's port first (it is on the child's command
    line) and answers `/health` would receive every prompt; the listener is checked to be
    the child's (a process of its session), and the child started again elsewhere."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a: object) -> None:
            pass

    squatter = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    taken = squatter.server_address[1]
    ports: list[int] = []

    def start(port: int) -> process.Child:
        ports.append(taken if not ports else port)
        slow = f"import time; time.sleep(2)\n{SERVER}"  # the squatter answers first
        return process.spawn("server", [sys.executable, "-c", slow, str(ports[-1])],
                             log_path=tmp_path / "server.log",
                             url=f"http://127.0.0.1:{ports[-1]}")  # fmt: skip

    try:
        child = asyncio.run(process.spawn_listening(start, 30))
        try:
            assert len(ports) == 2 and child.url.endswith(f":{ports[1]}") and ports[1] != taken
            process.check_listener(child)  # its own
        finally:
            process.kill(child)
    finally:
        squatter.shutdown()
        squatter.server_close()
