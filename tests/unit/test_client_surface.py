"""`libra.client`'s public surface, and a client / service import stays free of torch."""

from __future__ import annotations

import subprocess
import sys

import libra.client


def test_client_surface() -> None:
    assert sorted(libra.client.__all__) == ["AsyncClient", "Client", "Group", "ServiceError"]
    for name in libra.client.__all__:
        assert hasattr(libra.client, name)
    assert issubclass(libra.client.ServiceError, libra.LibraError)


def test_client_and_service_import_without_torch() -> None:
    code = (
        "import sys, libra.client, libra.service.server; "
        "print(','.join(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_only_answers_meaning_later_are_retried() -> None:
    err = libra.client.ServiceError
    assert err("unreachable").retriable and err("busy", 503).retriable
    assert err("spool disk full", 507).retriable
    assert not err("bad body", 400).retriable and not err("load failed", 502).retriable


def test_a_url_without_its_scheme_is_refused_and_no_service_is_not_healthy() -> None:
    """`Client("localhost:9")` retried every call for `reconnect_s` (5 minutes) before it
    failed; `healthy()` with nothing listening raised a ClientConnectorError."""
    import socket

    import pytest

    for url in ("localhost:9", "ftp://x", "http://"):
        with pytest.raises(ValueError, match="expected http://HOST:PORT"):
            libra.client.Client(url)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with libra.client.Client(f"http://127.0.0.1:{port}") as c:
        assert c.healthy() is False
