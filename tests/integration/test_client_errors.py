"""A refused call raises `ServiceError` whose message is the service's reason, down to
each endpoint's own (a weight update the engines refused says why), against a real
`libra serve-rollout` with its own embedded engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from libra.client import Client, ServiceError
from tests.integration.service_util import Service


@pytest.fixture
def service(tmp_path: Path, tiny_model: Path) -> Iterator[Service]:
    svc = Service(tmp_path, tiny_model, [], "--launch", "1", "--env", "arith")
    svc.start(timeout=240)
    try:
        yield svc
    finally:
        svc.close()


def test_a_refused_weight_update_says_why(service: Service, tmp_path: Path) -> None:
    empty = tmp_path / "step-1"
    empty.mkdir()
    with Client(service.url, reconnect_s=5) as c:
        with pytest.raises(ServiceError) as err:
            c.update_weights(1, str(empty))
        msg = str(err.value)
        assert msg.startswith("POST /v1/weights: HTTP 502: 1 of 1 endpoints did not load it; ")
        assert f"{empty}: no config.json" in msg  # the engine's reason, not only the count
        (url,) = err.value.detail["endpoints"]  # type: ignore[index]
        assert url in msg and err.value.status == 502

        with pytest.raises(ServiceError, match="HTTP 400: unknown env 'no-such-env'"):
            c.submit("no-such-env", [{"id": "t", "question": "?", "answer": "1"}])
