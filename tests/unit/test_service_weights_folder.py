"""`weights_dirs` in a config file may be relative: it is taken from where the service
starts, so a request's absolute path is compared with an absolute folder (comparing it
with a relative one raised ValueError: a 500 instead of a 403)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from libra.service.config import ServiceConfig
from libra.service.errors import RequestError
from libra.service.weights import weights_folder


def test_relative_weights_dirs_are_taken_from_the_start_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = ServiceConfig.model_validate({"weights_dirs": ["ckpts"]})
    assert cfg.weights_dirs == [str(tmp_path / "ckpts")]
    inside = str(tmp_path / "ckpts" / "step-3")
    assert weights_folder(inside, cfg.weights_dirs, exposed=True, local=False) == inside
    with pytest.raises(RequestError) as err:
        weights_folder(str(tmp_path / "other"), cfg.weights_dirs, exposed=True, local=False)
    assert err.value.status == 403 and "outside weights_dirs" in str(err.value)
    assert os.path.isabs(cfg.weights_dirs[0])
