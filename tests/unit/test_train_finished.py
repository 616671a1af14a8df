"""`libra train` on a run that already reached `steps` (e.g. `make run` twice): nothing
starts, it says so with the two ways on (start over, train further) and exits 3, which a
script tells apart from a training that ran (0)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from libra.train import load_config
from libra.train.setup import summarize
from libra.train.state import prepare_out, write_json
from tests.conftest import ROOT

CONFIG = "examples/cpu-train.toml"


def finished_run(out: Path) -> None:
    """A run folder as a finished run leaves it: config, state at `steps`, summary."""
    cfg = load_config(ROOT / CONFIG, {"out": str(out)})
    prepare_out(cfg, fresh=False)
    write_json(out / "state.json", {"version": cfg.steps, "stream": 0, "loop": {}})
    write_json(out / "summary.json", summarize(cfg, out, "done", 300.0, 500.0, []))


def libra_train(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "libra", "train", CONFIG, *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)  # fmt: skip


def test_a_finished_run_says_nothing_ran_and_exits_3(tmp_path: Path) -> None:
    out = tmp_path / "run"
    finished_run(out)
    steps = load_config(ROOT / CONFIG).steps
    before = sorted(p.name for p in out.iterdir())

    r = libra_train("--out", str(out), "--display", "off")
    assert r.returncode == 3, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == (
        f"nothing ran: {out} holds a run already trained to step {steps} (steps = {steps}); "
        "exit status 3"
    )
    # the hints name this run (its --out, and the --set flags of its config): without
    # them `--fresh` would have named the config's own out
    run = f"{CONFIG} --out {out}"
    assert lines[1].split() == ["start", "over:", "libra", "train", *run.split(), "--fresh",
                                "(deletes", f"{out})"]  # fmt: skip
    assert f"libra train {run} --steps N   (or --set steps=N), N > {steps}" in lines[2]
    assert lines[3].startswith("last run done: ")  # the old summary, not a new one
    assert sorted(p.name for p in out.iterdir()) == before  # nothing written, nothing started

    r = libra_train("--out", str(out), "--json")
    assert r.returncode == 3
    doc = json.loads(r.stdout)
    assert doc["outcome"] == "already-done" and doc["last_outcome"] == "done"
    assert doc["trained_steps"] == steps
    assert r.stderr.startswith("nothing ran: ")


def test_a_run_resumes_across_a_new_option_and_another_worker_count(tmp_path: Path) -> None:
    """A run folder written before an option existed (its config.json lacks the key)
    resumes with the option at its default; `rollout.workers` may change on resume
    (how many processes run episodes), and so may the limits that stop a run that cannot
    learn; another group size may not."""
    import pytest

    from libra.errors import ConfigError

    out = tmp_path / "run"
    finished_run(out)
    saved = json.loads((out / "config.json").read_text())
    del saved["rollout"]["workers"]  # as Libra wrote it before `workers` existed
    write_json(out / "config.json", saved)
    more = load_config(ROOT / CONFIG, {"out": str(out), "rollout.workers": 3})
    _, state = prepare_out(more, fresh=False)
    assert state is not None and state["version"] == more.steps  # resumed, not replaced
    # the limits a run stopped by `libra.train.guards` names, raised to go on
    limits = {"rollout.max_failed_steps": 9, "trainer.max_skipped_updates": 9}
    _, state = prepare_out(load_config(ROOT / CONFIG, {"out": str(out), **limits}), fresh=False)
    assert state is not None and state["version"] == more.steps
    other = load_config(ROOT / CONFIG, {"out": str(out), "rollout.group_size": 3})
    with pytest.raises(ConfigError, match=r"\(rollout differ\)"):
        prepare_out(other, fresh=False)
