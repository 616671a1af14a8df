"""`libra profile` against a real `libra serve-engine` (the tiny model on loopback), as a
user runs it: a profile file is written, `load_hardware` (so `libra plan`, `libra
simulate` and `[planner] hardware` of `libra train`) reads it, and on a batch x context
that was measured but not fitted, the planner's decode step time for that endpoint is
within 15% of the measured one.

No assertion on raw wall times of this shared machine: only the ratio of prediction to
measurement at the held-out point, both taken in the same run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from libra.planner import decode_step_time, load_hardware, load_model
from tests.conftest import ROOT, free_port, serve_engine

# The grid the tiny model on 2 shared cores is profiled on: 20 rounds of 32-token
# decode requests, each point's first quartile kept (docs/benchmarks.md has the figures
# and the command).
GRID = ["--batch", "1,4,16", "--context", "32,128,512", "--repeats", "20"]


def profile(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "libra", "profile", *args],
        cwd=ROOT,
        capture_output=True,
        timeout=timeout,
        check=False,
    )


def check_held_out(doc: dict[str, Any], out: Path, model_dir: Path) -> dict[str, Any]:
    """The profile loads, and its decode prediction at the held-out point, computed here
    by the planner's own function, is within 15% of what was measured there."""
    hw = load_hardware(str(out))
    assert hw.id == doc["id"]
    model = load_model(str(model_dir))
    (held,) = [r for r in doc["profile"]["held_out"] if r.get("phase") == "decode"]
    b, c = held["batch"], held["context"]
    assert b not in doc["profile"]["grid"]["batches"]
    predicted = decode_step_time(model, hw, held["tp"], b, b * c)
    ratio = predicted / (held["step_ms"] / 1e3)
    assert abs(ratio - 1.0) <= 0.15, (ratio, doc["profile"]["steps"])
    return held


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[str]:
    with serve_engine(tiny_model, timeout=60) as url:
        yield url


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_profile_of_the_embedded_engine_predicts_a_held_out_point(
    engine: str, tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "embedded.toml"
    r = profile(
        "--endpoint", f"tp1={engine}", *GRID, "--train-lengths", "128,512",
        "--out", str(out), "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    doc = json.loads(r.stdout)
    assert doc["out"] == str(out) and out.is_file()
    assert doc["profile"]["endpoints"][0]["kind"] == "embedded"
    check_held_out(doc, out, tiny_model)
    # Every number says where it came from; the fitted ones say measured, here, now.
    assert "fitted by `libra profile`" in doc["sources"]["efficiency.hbm"]
    assert doc["profile"]["created"] in doc["sources"]["efficiency.seq_overhead_us"]
    # The trainer micro-step ran on the endpoint's folder and set train_mfu.
    assert doc["sources"]["efficiency.train_mfu"].startswith("measured: trainer micro-step")
    assert [t["length"] for t in doc["profile"]["train"]] == [128, 512, 256]
    assert "train_mfu" in doc["profile"]["fit"]["fitted"]

    # `libra plan` takes the file instead of datasheet figures.
    trace = tmp_path / "trace.jsonl"
    from libra.sim.workloads import sample

    recs = sample("dapo-math", 4, 4, step=0, seed=0)
    trace.write_bytes(b"\n".join(x.to_json() for x in recs) + b"\n")
    plan = subprocess.run(
        [sys.executable, "-m", "libra", "plan", "--gpus", "2", "--hardware", str(out),
         "--model", str(tiny_model), "--workload", str(trace), "--json"],
        cwd=ROOT, capture_output=True, timeout=300, check=False,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr.decode()
    assert json.loads(plan.stdout)["hardware"] == doc["id"]


def test_an_unreachable_endpoint_is_one_line(tmp_path: Path) -> None:
    r = profile(
        "--endpoint", f"tp1=http://127.0.0.1:{free_port()}", "--out", str(tmp_path / "p.toml"),
        timeout=60,
    )  # fmt: skip
    err = r.stderr.decode()
    assert r.returncode == 2
    assert "cannot reach the endpoint" in err and err.count("\n") == 1, err
    assert not (tmp_path / "p.toml").exists()


def test_a_grid_longer_than_the_context_is_refused(engine: str, tmp_path: Path) -> None:
    r = profile(
        "--endpoint", f"tp1={engine}", "--context", "512,4096", "--base", "h100-80g",
        "--out", str(tmp_path / "p.toml"), timeout=60,
    )  # fmt: skip
    err = r.stderr.decode()
    assert r.returncode == 2 and err.count("\n") == 1, err
    assert "serves 4096 tokens of context" in err and "--context" in err
