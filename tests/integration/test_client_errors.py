"""A refused call raises `ServiceError` whose message is the service's reason, down to
each endpoint's own (a weight update the engines refused says why; a folder that is no
checkpoint is refused before them), against a real
`libra serve-rollout` with its own embedded engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

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


def test_a_refused_weight_update_says_why(
    service: Service, tmp_path: Path, tiny_model: Path
) -> None:
    empty = tmp_path / "step-1"
    empty.mkdir()
    broken = tmp_path / "step-2"  # looks like a checkpoint: the engine finds what is wrong
    broken.mkdir()
    (broken / "config.json").write_bytes((tiny_model / "config.json").read_bytes())
    save_file({"x": torch.zeros(2)}, str(broken / "model.safetensors"))
    with Client(service.url, reconnect_s=5) as c:
        with pytest.raises(ServiceError) as err:  # checked here, before any endpoint
            c.update_weights(1, str(empty))
        assert err.value.status == 400
        assert f"path '{empty}' is not a checkpoint (no config.json)" in str(err.value)
        with pytest.raises(ServiceError) as err:
            c.update_weights(2, str(broken))
        msg = str(err.value)
        assert msg.startswith("POST /v1/weights: HTTP 502: 1 of 1 endpoints did not load it; ")
        (url,) = err.value.detail["endpoints"]  # type: ignore[index]
        reason = err.value.detail["endpoints"][url]["error"]  # type: ignore[index]
        assert url in msg and reason in msg and err.value.status == 502  # the engine's own

        with pytest.raises(ServiceError, match="HTTP 400: unknown env 'no-such-env'"):
            c.submit("no-such-env", [{"id": "t", "question": "?", "answer": "1"}])
