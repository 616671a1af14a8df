"""Shared fixtures: a tiny model folder, fake vLLM servers on loopback, CI strictness."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from libra.cluster import process
from tests.fakes.vllm_fake import FakeVLLM

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


VLLM_STAGE = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("LIBRA_TEST_VLLM") != "1", reason="the vLLM stage (LIBRA_TEST_VLLM=1)"
    ),
]
"""`pytestmark` of the tests that run real vLLM servers: only in the CI vLLM stage
(`.ci/stage-vllm.sh` sets LIBRA_TEST_VLLM=1), skipped elsewhere."""


def need(condition: bool, reason: str) -> None:
    """Skip locally when a prerequisite is missing; fail under CI=true."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model, made once per session in a temp folder."""
    from libra.engine.model_maker import make_model

    return make_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def free_port() -> int:
    """A port for a server a test starts: Libra's own pick, below the ephemeral range,
    so no outgoing connection takes it before the server binds it."""
    return process.free_port()


class RunningFake:
    def __init__(self, fake: FakeVLLM, url: str):
        self.fake = fake
        self.url = url


@pytest.fixture
async def fake_vllm(tiny_model: Path) -> AsyncIterator[RunningFake]:
    """A fake vLLM server in this process (same event loop as the test)."""
    fake = FakeVLLM(str(tiny_model))
    runner = web.AppRunner(fake.app())
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield RunningFake(fake, f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def wait_http(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{url} did not come up in {timeout} s")


@contextlib.contextmanager
def serve_engine(model: Path, timeout: float = 60.0) -> Iterator[str]:
    """A real `libra serve-engine` for `model` on a free loopback port; yields its URL
    once `/health` answers, and stops it at the end."""
    with serve_engine_process(model, timeout) as (url, _):
        yield url


@contextlib.contextmanager
def serve_engine_process(
    model: Path, timeout: float = 60.0
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`serve_engine`, also yielding the process (for tests that kill it)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "libra", "serve-engine", "--model", str(model),
         "--port", str(port)],
        cwd=ROOT,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", timeout=timeout)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def spawn_fake(tiny_model: Path) -> Iterator[callable]:
    """Start fake vLLM servers as separate processes (so tests can kill them)."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(delay: float = 0.0) -> tuple[str, subprocess.Popen[bytes]]:
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests/fakes/vllm_fake.py"), "--model", str(tiny_model),
             "--port", str(port), "--delay", str(delay)],
            cwd=ROOT,
        )  # fmt: skip
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health")
        return url, proc

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


RAY_STORE = 80 << 20
"""Bytes of object store per node of the test Ray cluster: Libra puts nothing big there."""


def grow(cluster: Any, n: int) -> list[Any]:
    """Add `n` nodes of one logical CPU (an engine or a trainer rank each) to the shared
    Ray cluster (`ray_cluster`)."""
    nodes = [cluster.add_node(num_cpus=1, object_store_memory=RAY_STORE) for _ in range(n)]
    cluster.wait_for_nodes()
    return nodes


def shrink(cluster: Any, to: int = 2) -> None:
    """Leave the shared cluster as the fixture made it: `to` CPU nodes."""
    for node in list(cluster.worker_nodes)[: max(0, len(cluster.worker_nodes) - to)]:
        cluster.remove_node(node)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[object]:
    """A local Ray cluster of three nodes on this machine, shared by every Ray test: a
    head without CPUs (nothing is placed there) and two nodes of one logical CPU each,
    so that engines reserving a CPU each land on different nodes. A test may add a node
    and kill one (a lost node), leaving two again. Dashboard off, small object stores.
    Skips without ray (fails under CI=true)."""
    import importlib.util

    need(
        importlib.util.find_spec("ray") is not None,
        "ray is not installed (pip install 'libra-rl[ray]')",
    )
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "include_dashboard": False,
            "object_store_memory": RAY_STORE,
        },
    )
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, object_store_memory=RAY_STORE)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()
