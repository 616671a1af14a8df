"""`[cluster]` in a `libra train` config: a bad address fails at load with the field's
path; asking for Ray without it installed is one line naming the install command."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from libra.errors import ConfigError
from libra.train import load_config, placement


def write(tmp_path: Path, cluster: str) -> Path:
    path = tmp_path / "train.toml"
    path.write_text(f'out = "{tmp_path}/run"\n\n[cluster]\n{cluster}\n')
    return path


def test_defaults_to_this_machine(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, ""))
    assert cfg.cluster.backend == "local"


@pytest.mark.parametrize("address", ["auto", "local", "10.0.0.1:6379", "ray://head:10001"])
def test_ray_addresses(tmp_path: Path, address: str) -> None:
    cfg = load_config(write(tmp_path, f'backend = "ray"\naddress = "{address}"'))
    assert cfg.cluster.address == address


def test_a_bad_address_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cluster\.address"):
        load_config(write(tmp_path, 'backend = "ray"\naddress = "my-head"'))


def test_ray_without_ray_is_one_line_with_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    cfg = load_config(write(tmp_path, 'backend = "ray"'))
    with pytest.raises(ConfigError) as got:
        placement.launcher(cfg)
    assert "pip install 'libra-rl[ray]'" in str(got.value)
    assert "\n" not in str(got.value)


def test_vllm_on_ray_needs_no_local_gpu_list(tmp_path: Path) -> None:
    """On Ray each vLLM server's GPUs are the ones Ray gives its actor: a GPU config
    without `fleet.vllm.gpus` is fine there (a local run is told to list them)."""
    cfg = load_config(write(tmp_path, 'backend = "ray"'))
    cfg.fleet.kind = "vllm"
    assert placement.gpu_problem(cfg) is None
    cfg.cluster.backend = "local"
    assert "fleet.vllm.gpus" in (placement.gpu_problem(cfg) or "")


@pytest.mark.parametrize("command", ["serve-rollout", "rollout"])
def test_a_config_after_ray_is_named_not_taken_for_an_address(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--ray` takes an optional address, so `--ray run.toml` would swallow the config:
    one line says so and how to write it, before anything starts."""
    from libra.cli import main

    assert main([command, "--ray", "service.toml"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("libra: error: --ray took 'service.toml' as the Ray cluster's address")
    assert "service.toml --ray" in err and "\n" not in err
