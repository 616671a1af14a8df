"""`libra train` deletes only a run's folder: `--fresh` deleted whatever `out` named (a
folder of notes, with `--out ""` the working folder), and a model folder, which has a
`config.json`, was taken for a run that never reached a checkpoint and replaced."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from libra.engine.model_maker import make_model
from libra.errors import ConfigError
from libra.train import load_config
from libra.train.state import prepare_out, write_json
from tests.conftest import ROOT

CONFIG = ROOT / "examples/cpu-train.toml"


def config(out: Path | str) -> object:
    return load_config(CONFIG, {"out": str(out)})


def test_fresh_replaces_a_run_and_nothing_else(tmp_path: Path) -> None:
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "precious.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not a libra train run, so it is left as it is"):
        prepare_out(config(notes), fresh=True)
    assert (notes / "precious.txt").read_text() == "mine"
    # a run (its config.json is a run's config) is replaced
    run = tmp_path / "run"
    prepare_out(config(run), fresh=False)
    write_json(run / "state.json", {"version": 2, "stream": 0, "loop": {}})
    (run / "metrics.jsonl").write_text("{}\n")
    _, state = prepare_out(config(run), fresh=True)
    assert state is None and sorted(p.name for p in run.iterdir()) == ["config.json"]


def test_a_model_folder_is_not_taken_for_a_run(tmp_path: Path) -> None:
    model = tmp_path / "model"
    make_model(model)
    before = sorted(p.name for p in model.iterdir())
    for fresh in (False, True):
        with pytest.raises(ConfigError, match="not a libra train run"):
            prepare_out(config(model), fresh=fresh)
    assert sorted(p.name for p in model.iterdir()) == before


def test_the_working_folder_and_files_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match="out: Value error, names no folder"):
        config("")
    run = tmp_path / "run"
    prepare_out(config(run), fresh=False)  # a run's folder, but the one we are in
    monkeypatch.chdir(run)
    with pytest.raises(ConfigError, match="is the working folder or holds it"):
        prepare_out(config("."), fresh=True)
    assert (run / "config.json").is_file() and Path(os.getcwd()) == run
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ConfigError, match="is a file; name a folder"):
        prepare_out(config(afile), fresh=True)
    assert afile.read_text() == "x"


def test_a_link_or_a_damaged_state_is_one_error_not_a_traceback(tmp_path: Path) -> None:
    """`out` a symbolic link to a run: `OSError: Cannot call rmtree on a symbolic link`;
    a state.json that is not JSON: a JSONDecodeError; one without its config.json: a
    FileNotFoundError."""
    run = tmp_path / "run"
    prepare_out(config(run), fresh=False)
    link = tmp_path / "link"
    link.symlink_to(run)
    for fresh in (False, True):
        with pytest.raises(ConfigError, match="is a symbolic link .* name the folder itself"):
            prepare_out(config(link), fresh=fresh)
    assert (run / "config.json").is_file()
    (run / "state.json").write_text("{not json")
    with pytest.raises(ConfigError, match="state.json cannot be read .* pass --fresh"):
        prepare_out(config(run), fresh=False)
    _, state = prepare_out(config(run), fresh=True)  # what the message says works
    assert state is None
    write_json(run / "state.json", {"version": 2, "stream": 0, "loop": {}})
    (run / "config.json").unlink()
    with pytest.raises(ConfigError, match="holds a state.json but its config.json cannot be"):
        prepare_out(config(run), fresh=False)


def test_an_endpoint_api_key_is_not_written_to_the_run_and_may_change_on_resume(
    tmp_path: Path,
) -> None:
    """The run folder's config.json (world-readable under the usual umask) and the
    tracker's copy (`Config.public`) hold a mark, not the key; a resume with another
    key (a rotated one) is the same run."""
    run = tmp_path / "run"
    cfg = load_config(CONFIG, {"out": str(run), "rollout.endpoint.api_key": "sk-SECRET-123"})
    prepare_out(cfg, fresh=False)
    assert "sk-SECRET" not in (run / "config.json").read_text()
    assert "sk-SECRET" not in str(cfg.public())
    assert cfg.public()["rollout"]["endpoint"]["api_key"] == "<set; not saved>"
    assert cfg.rollout.endpoint.api_key == "sk-SECRET-123"  # what the pool sends
    write_json(run / "state.json", {"version": 1, "stream": 0, "loop": {}})
    for key in ("sk-ROTATED", None):
        again = load_config(CONFIG, {"out": str(run), "rollout.endpoint.api_key": key})
        _, state = prepare_out(again, fresh=False)
        assert state is not None and state["version"] == 1
