"""`libra bench sim-grid` on a tiny grid: every figure the issue asks for is there."""

from __future__ import annotations

import math

import pytest

from libra.bench.sim_grid import run_grid
from libra.cli import main
from libra.sim.systems import resolve


def test_sim_grid_on_a_tiny_grid_returns_every_figure():
    doc = run_grid(["search-r1"], [16], [1], 2, 3, systems="all")
    (cell,) = doc["cells"]
    assert cell["seeds"] == [0, 1] and cell["prompts"] == 32
    assert set(cell["throughput"]) == {s.name for s in resolve("all")}
    for key in ("libra_over_best_baseline", "ceiling_over_best_baseline"):
        assert cell[key]["min"] <= cell[key]["mean"] <= cell[key]["max"]
    assert set(cell["libra_over"]) == {
        "verl-colocated", "verl-static-uniform", "verl-greedy-heuristic",
        "areal-static-optimal", "best-static-colocated",
    }  # fmt: skip
    assert "captured" in cell
    s = doc["summary"]
    assert s["worst_cell"]["workload"] == "search-r1" and s["cells"] == 1
    assert math.isclose(
        s["geomean_libra_over_best_baseline"], cell["libra_over_best_baseline"]["mean"],
        rel_tol=1e-3,
    )  # fmt: skip
    assert s["geomean_ceiling_over_best_baseline"] is not None
    assert doc["steps"] == 3 and doc["seeds"] == 2
    # Libra's forward model, scored on every layout it chose (at least its first, on
    # both seeds) against what the simulation then measured
    f = cell["libra_forecast"]
    assert f["scored"] >= 2 and 0 <= f["median_rel_error"] < 1
    assert s["libra_forecasts_scored"] == f["scored"]
    assert s["libra_forecast_median_rel_error"] == f["median_rel_error"]


def test_a_grid_of_libra_alone_still_scores_its_forward_model():
    """`--systems libra`: no baseline to rate against, but the forecasts are scored (the
    cheap way to measure the forward model over the whole grid), and the table renders."""
    from libra.bench.sim_grid import render

    doc = run_grid(["search-r1"], [16], [1], 1, 2, systems="libra")
    s = doc["summary"]
    assert "worst_cell" not in s and s["libra_forecasts_scored"] >= 1
    assert 0 <= s["libra_forecasts_within_10pct"] <= 1 and s["libra_forecasts_infinite"] >= 0
    assert "Libra's forward model: median" in render(doc)


def test_a_baseline_that_cannot_run_on_the_cells_cluster_sets_no_bar():
    """Qwen3-32B does not train on the 8 H100s an even split leaves it: the cell rates
    Libra against the baselines that ran and says which could not."""
    from libra.bench.sim_grid import render

    doc = run_grid(["search-r1"], [16], [1], 1, 2, model="qwen3-32b", hardware="h100-80g",
                   systems="verl-static-uniform,areal-static-optimal,libra")  # fmt: skip
    (cell,) = doc["cells"]
    assert set(cell["cannot_run"]) == {"verl-static-uniform"}
    assert set(cell["libra_over"]) == {"areal-static-optimal"}
    assert set(cell["throughput"]) == {"areal-static-optimal", "libra"}
    assert "cannot run on this cluster: verl-static-uniform" in render(doc)


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--gpus", "x"], "--gpus 'x': expected integers >= 2 separated by commas"),
     (["--gpus", "1"], "--gpus '1': expected integers >= 2"),
     (["--prompt-scales", "0"], "--prompt-scales '0': expected integers >= 1")],
)  # fmt: skip
def test_bad_grid_flags_are_one_line_before_anything_runs(flags, message, capsys):
    """`--prompt-scales 0` and `--gpus 1` ended in a worker's pydantic traceback,
    `--gpus x` in a ValueError traceback."""
    assert main(["bench", "sim-grid", *flags, "--seeds", "1", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"libra: error: {message}"), err


def test_count_flags_take_integers_of_at_least_one(capsys):
    for argv in (["--seeds", "0"], ["--steps", "-2"], ["--jobs", "two"]):
        with pytest.raises(SystemExit) as ended:  # argparse's own exit, code 2
            main(["bench", "sim-grid", *argv])
        assert ended.value.code == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"libra: error: argument {argv[0]}: expected an integer >= 1")
