"""`POST /v1/weights` takes a folder path from the client, and a client's path is
untrusted (issue 14): with `weights_dirs` it must lie inside them, links resolved, and a
service reachable from other hosts loads nothing until they are set. Each refusal is one
403 naming the fix, before any endpoint is touched. A real `libra serve-rollout`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from libra.client import Client, ServiceError
from tests.integration.service_util import Service


def test_weight_paths_outside_weights_dirs_are_refused(
    tmp_path: Path, tiny_model: Path, spawn_fake
) -> None:
    url, _ = spawn_fake()
    ckpts, other = tmp_path / "ckpts", tmp_path / "other"
    ckpts.mkdir(), other.mkdir()
    os.symlink(other, ckpts / "escape")
    svc = Service(tmp_path, tiny_model, [url], "--env", "arith", "--weights-dir", str(ckpts))
    svc.start()
    try:
        with Client(svc.url, reconnect_s=5) as c:
            refused = {
                str(other): "is outside weights_dirs",
                str(ckpts / ".." / "other"): "is outside weights_dirs",
                str(ckpts / "escape"): f"(it resolves to '{other}') is outside weights_dirs",
                "ckpts/step-1": "is not absolute",
            }
            for path, why in refused.items():
                with pytest.raises(ServiceError) as err:
                    c.update_weights(1, path)
                assert err.value.status == 403 and why in str(err.value), (path, err.value)
            # Inside: past the check, on to the next: no checkpoint there (400) ...
            with pytest.raises(ServiceError) as err:
                c.update_weights(1, str(ckpts / "step-1"))
            assert err.value.status == 400 and "is not a checkpoint" in str(err.value)
            # ... and with one, on to the endpoint (the fake one cannot load it: 502).
            (ckpts / "step-1").mkdir()
            for name in ("config.json", "model.safetensors"):
                (ckpts / "step-1" / name).write_bytes((tiny_model / name).read_bytes())
            with pytest.raises(ServiceError) as err:
                c.update_weights(1, str(ckpts / "step-1"))
            assert err.value.status == 502 and "did not load it" in str(err.value)
    finally:
        svc.close()


def test_an_exposed_service_loads_weights_only_from_weights_dirs(
    tmp_path: Path, tiny_model: Path, spawn_fake
) -> None:
    url, _ = spawn_fake()
    svc = Service(tmp_path, tiny_model, [url], "--env", "arith", "--host", "0.0.0.0",
                  "--token", "s3cret")  # fmt: skip
    svc.start()
    try:
        with Client(svc.url, token="s3cret", reconnect_s=5) as c:
            with pytest.raises(ServiceError) as err:
                c.update_weights(1, str(tmp_path))
            assert err.value.status == 403 and "--weights-dir DIR" in str(err.value)
    finally:
        svc.close()
