"""`[launch] kind = "vllm"` for `libra rollout` / `libra serve-rollout`: what a launch
that cannot start says, before anything starts (the servers themselves run in the CI
vLLM stage, tests/integration/test_serve_rollout_vllm.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from libra.cluster.backend import launch_placement, vllm_python
from libra.cluster.config import ClusterSection, LaunchSection
from libra.errors import ConfigError
from tests.conftest import ROOT


def _rollout(tmp_path: Path, config: str, *flags: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "r.toml"
    path.write_text(config)
    env = {k: v for k, v in os.environ.items() if k != "LIBRA_VLLM_PYTHON"}
    cmd = [sys.executable, "-m", "libra", "rollout", str(path), "--out",
           str(tmp_path / "out.jsonl"), "--quiet", *flags]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


def _one_line(r: subprocess.CompletedProcess[str], *parts: str) -> None:
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for part in parts:
        assert part in lines[0], lines[0]


def test_a_vllm_launch_without_an_interpreter_is_refused_in_one_line(tmp_path: Path) -> None:
    r = _rollout(
        tmp_path, '[launch.vllm]\ndevice = "cpu"\n', "--launch", "1", "--launch-kind", "vllm"
    )
    _one_line(r, "launch.vllm.python", "LIBRA_VLLM_PYTHON")
    out = tmp_path / "out.jsonl"
    assert not out.exists() or not out.read_text()  # no episode ran


def test_an_interpreter_without_vllm_is_refused_in_one_line(tmp_path: Path) -> None:
    config = (
        f'[launch]\nkind = "vllm"\n[launch.vllm]\npython = "{sys.executable}"\ndevice = "cpu"\n'
    )
    if subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True).returncode == 0:
        pytest.skip("this interpreter has vllm")
    _one_line(
        _rollout(tmp_path, config, "--launch", "1"), "launch.vllm.python", "cannot import vllm"
    )


def test_gpus_that_do_not_cover_the_launched_servers_are_refused_before_any_starts(
    tmp_path: Path,
) -> None:
    # tp1 x 2 + tp2 x 2 = 6 GPUs; the interpreter is never asked (the GPUs fail first)
    config = (
        '[launch]\nkind = "vllm"\n[launch.vllm]\npython = "/nonexistent/python"\ngpus = [0, 1, 2]\n'
        '[[buckets]]\nname = "tp1"\ntp = 1\nlaunch = 2\n'
        '[[buckets]]\nname = "tp2"\ntp = 2\nlaunch = 2\n'
    )
    _one_line(_rollout(tmp_path, config), "launch.vllm.gpus", "need 6 GPU(s)", "3 listed")


def test_launched_servers_take_their_bucket_s_tp_in_gpus_or_cores() -> None:
    cuda = LaunchSection(kind="vllm", vllm={"gpus": [4, 5, 6, 7]})
    where = launch_placement(cuda, ClusterSection(), 3)
    assert where.assign("tp2-0", 2).devices == (4, 5)
    assert where.assign("tp1-0", 1).devices == (6,)
    assert where.assign("tp2-0", 2).devices == (4, 5)  # started again: the same GPUs
    with pytest.raises(ConfigError, match="lists a GPU twice"):
        launch_placement(LaunchSection(kind="vllm", vllm={"gpus": [0, 0]}), ClusterSection(), 1)
    cores = launch_placement(
        LaunchSection(kind="vllm", vllm={"device": "cpu"}), ClusterSection(), 0
    )
    assert cores.kind == "cpu" and len(cores.assign("tp2-0", 2).devices) == 2  # one per rank
    embedded = launch_placement(LaunchSection(), ClusterSection(), 0)
    assert embedded.assign("tp1-0", 1).devices == ()  # unpinned, as before
    on_ray = launch_placement(cuda, ClusterSection(backend="ray"), 3)
    assert on_ray.assign("tp2-0", 2).node == "ray"  # Ray picks the node and its GPUs


def test_the_interpreter_check_names_the_table_it_was_set_in(tmp_path: Path) -> None:
    section = LaunchSection(kind="vllm", vllm={"python": str(tmp_path / "nope")}).vllm
    with pytest.raises(ConfigError, match=r"^launch\.vllm\.python: .* does not exist"):
        vllm_python(section, "launch.vllm")
