"""`libra simulate` from the command line: output, plots, and one clear line for bad input."""

from __future__ import annotations

import json

import pytest

from libra.cli import main

SMALL = ["--workload", "search-r1", "--gpus", "16", "--steps", "3", "--prompts", "4",
         "--group", "8", "--jobs", "1"]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--gpus", "1"], "--gpus must be >= 2"),
        (["--steps", "0"], "argument --steps: expected an integer >= 1, got 0"),
        (["--staleness", "0"], "argument --staleness: expected an integer >= 1, got 0"),
        (["--systems", "libra,verl-turbo"], "unknown system 'verl-turbo'; known: all,"),
        (["--systems", ","], "--systems names no system"),
        (["--workload", "swe-bench"], "unknown workload 'swe-bench'; known: search-r1"),
        (["--workload", "missing.jsonl"], "no such trace file"),
        (["--model", "qwen9"], "unknown model 'qwen9'"),
        (["--hardware", "local"], "--hardware local describes this machine"),
        (["--pipeline", "eager"], "invalid choice: 'eager'"),
        (["--gpus", "abc"], "invalid int value: 'abc'"),
        (
            ["--routing", "objective=speed"],
            "routing.objective: Input should be 'accuracy' or 'cost'",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    try:
        rc = main(["simulate", *argv])
    except SystemExit as e:  # argparse's own checks (types, choices)
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("libra: error:") and needle in err
    assert "Traceback" not in err


def test_plot_to_a_file_is_refused(tmp_path, capsys):
    f = tmp_path / "x.png"
    f.write_text("")
    assert main(["simulate", *SMALL, "--plot", str(f)]) == 2
    assert "is a file; pass a directory" in capsys.readouterr().err


def test_json_table_and_plots(tmp_path, capsys):
    out = tmp_path / "plots"
    assert main(["simulate", *SMALL, "--systems", "verl-colocated,libra", "--json",
                 "--plot", str(out)]) == 0  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert [r["system"] for r in doc["systems"]] == ["verl-colocated", "libra"]
    for r in doc["systems"]:
        assert r["throughput"] > 0 and len(r["per_step"]) == 3
        assert set(r["utilization"]) == {"rollout", "training", "reconfiguration", "idle"}
    assert doc["timing"]["cpu_s"] > 0 and doc["timing"]["wall_s"] > 0
    for name in ("throughput.png", "allocation-libra.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert main(["simulate", *SMALL, "--systems", "ladder"]) == 0
    table = capsys.readouterr().out
    assert "libra /" in table and "libra-hetero-tp" in table and "simulated in" in table
    assert "libra / : Libra's throughput divided by the row's" in table


def test_the_paper_tp_variants_roll_out_on_tp2_only(capsys):
    """`--systems paper-tp`: each baseline as the paper's reference code ran it, every
    rollout instance TP-2 from the first layout to the last (the tuned baselines pick
    the fastest TP size, and `all` leaves the variants out)."""
    from libra.sim.systems import GROUPS

    assert not [n for n in GROUPS["all"] if "@" in n]
    assert main(["simulate", *SMALL, "--systems", "paper-tp", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    names = [r["system"] for r in doc["systems"]]
    assert names == ["verl-colocated@tp2", "verl-static-uniform@tp2",
                     "verl-greedy-heuristic@tp2", "areal-static-optimal@tp2", "libra"]  # fmt: skip
    for r in doc["systems"][:-1]:
        assert r["throughput"] > 0
        for when in ("initial", "final"):
            assert set(r["layout"][when]["rollout"]) == {"tp2"}, (r["system"], r["layout"])
    assert set(doc["static_search"]) == {"disaggregated@tp2"}


def test_libra_scores_its_forward_model_on_the_layouts_it_chose(capsys):
    """Each layout Libra chooses is scored once, on its first step run wholly in it,
    against the prediction made before it ran; systems that never replan have none."""
    assert main(["simulate", *SMALL, "--systems", "libra,verl-colocated", "--json"]) == 0
    libra, colocated = json.loads(capsys.readouterr().out)["systems"]
    assert colocated["forward_model"] is None
    f = libra["forward_model"]
    assert f["scored"] == len(f["scores"]) >= 1
    applied = sum(1 for d in libra["decisions"] if d.get("apply"))
    assert f["scored"] <= 1 + applied  # the first layout and each change, at most once
    steps = [x["step"] for x in f["scores"]]
    assert steps == sorted(set(steps))
    for x in f["scores"]:
        err = abs(x["predicted_t_iter_s"] - x["measured_t_iter_s"]) / x["measured_t_iter_s"]
        assert x["rel_error"] == pytest.approx(err, abs=2e-3)


def test_routing_options_reach_every_systems_policy(capsys):
    """`--routing KEY=VALUE` is the run's routing table (`SimConfig.routing`, which the
    cluster hands to `make_policy`), echoed in the JSON config."""
    argv = ["simulate", *SMALL, "--systems", "libra-cmlfq", "--json"]
    assert main([*argv, "--routing", "objective=accuracy"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["config"]["routing"]["objective"] == "accuracy"
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["config"]["routing"]["objective"] is None


SHORT_OF_MEMORY = ["--workload", "search-r1", "--gpus", "16", "--model", "qwen3-32b",
                   "--hardware", "h100-80g", "--steps", "2", "--prompts", "4",
                   "--group", "8", "--jobs", "1"]  # fmt: skip
"""Qwen3-32B's training state does not fit on the 8 H100s an even split leaves it."""


def test_a_system_that_cannot_run_on_the_cluster_is_reported_and_the_others_run(capsys):
    argv = ["simulate", *SHORT_OF_MEMORY, "--systems", "verl-colocated,verl-static-uniform,libra"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    by = {r["system"]: r for r in doc["systems"]}
    assert "does not fit on 8 x h100-80g" in by["verl-static-uniform"]["error"]
    assert "throughput" not in by["verl-static-uniform"]
    assert by["verl-colocated"]["throughput"] > 0 and by["libra"]["throughput"] > 0
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "verl-static-uniform    cannot run: qwen3-32b training does not fit" in table
    # Nothing to report when no system asked for can run: exit 2 and one error line
    # (after the progress lines).
    assert main(["simulate", *SHORT_OF_MEMORY, "--systems", "verl-static-uniform"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        "libra: error: no system can run qwen3-32b on 16 x h100-80g (verl-static-uniform: "
        "qwen3-32b training does not"
    )
    assert err[-1].endswith("give more --gpus or a smaller --model")
    assert sum(line.startswith("libra: error") for line in err) == 1
