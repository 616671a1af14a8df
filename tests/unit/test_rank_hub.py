"""The driver's hub that trainer ranks on other nodes call back
(`libra.trainer.remote.Hub`): a rank with the run's key gets its spec, with its own
node's address, and a connection that carries commands; a caller without the key, one
naming no rank the driver started, and one that stays silent get nothing and are
closed. Real sockets on loopback."""

from __future__ import annotations

import socket
import time
from multiprocessing.connection import AuthenticationError, Client
from typing import Any

import pytest

from libra.cluster.raychildren import ENV_HOST as SET_BY_ACTOR
from libra.trainer import remote
from libra.trainer.remote import ENV_ADDR, ENV_HOST, ENV_KEY, ENV_NAME, Hub
from libra.trainer.worker import WorkerSpec


def spec(rid: str) -> WorkerSpec:
    return WorkerSpec("{}", rid, "core", 0, 1, [rid], 1234, store_host="10.0.0.1")


def call(hub: Hub, key: bytes, name: str, host: str) -> Any:
    addr, port = hub.address.rsplit(":", 1)
    conn = Client((addr, int(port)), family="AF_INET", authkey=key)
    conn.send((name, host))
    return conn


def taken(hub: Hub, name: str) -> Any:
    deadline = time.monotonic() + 5
    while (got := hub.take(name)) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


def test_a_rank_with_the_key_gets_its_spec_and_a_command_channel() -> None:
    hub = Hub("127.0.0.1", "127.0.0.1")
    try:
        env = hub.env("core0/0")
        assert env[ENV_ADDR] == hub.address and env[ENV_NAME] == "core0/0"
        hub.expect("core0/0", spec("core0"))
        rank = call(hub, bytes.fromhex(env[ENV_KEY]), "core0/0", "10.0.0.7")
        got = rank.recv()
        assert (got.member_id, got.host, got.store_host) == ("core0", "10.0.0.7", "10.0.0.1")
        driver = taken(hub, "core0/0")
        assert driver is not None
        driver.send(("stop",))
        assert rank.recv() == ("stop",)
        # the spec is handed out once: a second caller under that name gets nothing
        again = call(hub, hub.key, "core0/0", "10.0.0.8")
        with pytest.raises((EOFError, OSError)):
            again.recv()
    finally:
        hub.close()


def test_strangers_get_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "HELLO_TIMEOUT_S", 1.0)
    hub = Hub("127.0.0.1", "127.0.0.1")
    try:
        hub.expect("core0/0", spec("core0"))
        with pytest.raises(AuthenticationError):
            call(hub, b"not the key" * 3, "core0/0", "10.0.0.9")
        unknown = call(hub, hub.key, "core9/0", "10.0.0.9")
        with pytest.raises((EOFError, OSError)):
            unknown.recv()
        addr, port = hub.address.rsplit(":", 1)
        with socket.create_connection((addr, int(port))) as silent:
            silent.settimeout(10)
            got = b""
            while chunk := silent.recv(4096):  # the challenge, then closed
                got += chunk
            assert b"CHALLENGE" in got
        assert hub.take("core0/0") is None and hub.take("core9/0") is None
        # the expected rank still gets its spec after all that
        rank = call(hub, hub.key, "core0/0", "10.0.0.7")
        assert rank.recv().member_id == "core0"
    finally:
        hub.close()


def test_the_actor_sets_the_variable_the_rank_reads() -> None:
    assert SET_BY_ACTOR == ENV_HOST
