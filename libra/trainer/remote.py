"""Trainer ranks started on another node: they call the driver back.

A rank on this machine gets its pipe from `multiprocessing`. A rank started elsewhere
(by a Ray actor on its node: `libra.train.rayranks`) runs `python -m
libra.trainer.remote`, connects to the driver's `Hub` over TCP (multiprocessing's
HMAC handshake with the run's key: nothing without the key gets a spec or sends a
command), says which rank it is and its node's address, and receives its `WorkerSpec`.
From then on that connection is its pipe: the protocol of `libra.trainer.worker`.

The key and the hub's address reach the rank in its environment, set by whoever starts
it (`ENV_*` below), never on a command line.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
from multiprocessing.connection import (
    Client,
    Connection,
    Listener,
    answer_challenge,
    deliver_challenge,
)

from libra.trainer.worker import WorkerSpec

log = logging.getLogger("libra.trainer")

ENV_ADDR = "LIBRA_RANK_ADDR"
"""HOST:PORT of the driver's hub."""
ENV_KEY = "LIBRA_RANK_KEY"
"""The run's key, hex."""
ENV_NAME = "LIBRA_RANK_NAME"
"""Which rank this process is: `{replica}/{rank}`."""
ENV_HOST = "LIBRA_NODE_HOST"
"""The address of this rank's node (its sockets bind there): set by what starts it on
a node (`libra.cluster.raychildren.ENV_HOST`, the same name; the trainer does not
import the cluster layer)."""

HELLO_TIMEOUT_S = 30.0
"""How long an accepted connection may take to authenticate and say who it is."""


class Hub:
    """The driver's end: accepts ranks that call back and hands each its spec.

    `expect(name, spec)` before the rank is started; `take(name)` returns its
    connection once it has called back (None until then). Connections that fail the
    handshake, name no expected rank, or stay silent are closed; each is handled in
    its own thread, so one that stalls holds up nobody."""

    def __init__(self, bind: str, advertise: str):
        self.key = secrets.token_bytes(32)
        self._listener = Listener((bind, 0), family="AF_INET", backlog=64)
        port = self._listener.address[1]
        self.address = f"{advertise}:{port}"
        self._lock = threading.Lock()
        self._specs: dict[str, WorkerSpec] = {}
        self._conns: dict[str, Connection] = {}
        self._closed = False
        # only Python socket code runs here: a daemon thread is safe (libra.trainer.rendezvous)
        threading.Thread(target=self._accept, name="rank-hub", daemon=True).start()

    def env(self, name: str) -> dict[str, str]:
        """The environment a rank `name` needs to call back."""
        return {ENV_ADDR: self.address, ENV_KEY: self.key.hex(), ENV_NAME: name}

    def expect(self, name: str, spec: WorkerSpec) -> None:
        with self._lock:
            self._specs[name] = spec

    def take(self, name: str) -> Connection | None:
        with self._lock:
            return self._conns.get(name)

    def forget(self, name: str) -> None:
        """`name` will not call back (it was stopped): a late call is refused."""
        with self._lock:
            self._specs.pop(name, None)

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._hello, args=(conn,), name="rank-hello",
                             daemon=True).start()  # fmt: skip

    def _hello(self, conn: Connection) -> None:
        try:
            # a socket timeout bounds the handshake's reads (they cannot be polled)
            _timeout(conn, HELLO_TIMEOUT_S)
            deliver_challenge(conn, self.key)
            answer_challenge(conn, self.key)
            if not conn.poll(HELLO_TIMEOUT_S):
                raise TimeoutError("no hello")
            name, host = conn.recv()
            with self._lock:
                spec = self._specs.pop(str(name), None)
            if spec is None:
                raise ValueError(f"no rank {name!r} is expected")
            conn.send(dataclasses.replace(spec, host=str(host) or spec.host))
            _timeout(conn, None)
            with self._lock:
                self._conns[str(name)] = conn
        except Exception as e:  # a stranger, a wrong key, a rank no longer wanted
            log.warning("refused a trainer rank's connection: %s", e)
            conn.close()


def _timeout(conn: Connection, seconds: float | None) -> None:
    """Bound each blocking read on `conn` (SO_RCVTIMEO: a read that waits longer fails);
    None: no bound. A socket option, not the descriptor's non-blocking flag, which
    multiprocessing's reads do not expect."""
    import socket
    import struct

    s = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        whole = int(seconds or 0)
        tv = struct.pack("ll", whole, int(((seconds or 0) - whole) * 1e6))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    finally:
        s.close()  # the duplicate only; the socket lives on in `conn`


def main() -> None:
    """A rank on a node: call the hub back, get the spec, serve (`worker.main`)."""
    from libra.trainer.worker import main as serve

    host, port = os.environ[ENV_ADDR].rsplit(":", 1)
    conn = Client((host, int(port)), family="AF_INET", authkey=bytes.fromhex(os.environ[ENV_KEY]))
    conn.send((os.environ[ENV_NAME], os.environ.get(ENV_HOST, "")))
    spec = conn.recv()
    serve(spec, conn)


if __name__ == "__main__":
    main()


__all__ = ["ENV_ADDR", "ENV_HOST", "ENV_KEY", "ENV_NAME", "Hub", "main"]
