"""`libra profile`, the parts without an endpoint: the profile file (TOML that
`load_hardware` reads, with its `[profile]` table), the profiling config and its
held-out point, bad flags as one line, `--help`."""

from __future__ import annotations

import math
import tomllib

import pytest

from libra.cli import main
from libra.planner import hardware_from_dict, hardware_to_dict, load_hardware, load_model
from libra.profiling import tomlfile
from libra.profiling.config import ProfileConfig
from tests.unit.test_planner_fit import TINY


def test_a_written_profile_loads_as_hardware(tmp_path):
    hw = load_hardware("h100-80g")
    doc = hardware_to_dict(hw) | {
        "profile": {
            "created": "2026-01-01T00:00:00+00:00",
            "fit": {"rms_log_error": 0.05, "request_overhead_ms": {"http://x:1": 1.5}},
            "held_out": [{"phase": "decode", "error": -0.03, "repeats_ms": [1.0, 2.5e-7]}],
            "steps": [{"phase": "decode", "held_out": False, "error": math.inf}],
        }
    }
    path = tmp_path / "p.toml"
    path.write_text(tomlfile.dumps(doc, "a header\nover two lines"))
    text = path.read_text()
    assert text.startswith("# a header\n# over two lines\n")
    back = tomllib.loads(text)
    assert back["profile"]["fit"]["request_overhead_ms"] == {"http://x:1": 1.5}
    assert back["profile"]["held_out"][0]["repeats_ms"] == [1.0, 2.5e-7]
    assert back["sources"] == dict(hw.sources)
    loaded = load_hardware(str(path))
    assert loaded == hardware_from_dict(doc)
    assert loaded.flops == hw.flops
    assert loaded.eff.step_overhead_s == pytest.approx(hw.eff.step_overhead_s)


def test_profile_config_holds_out_a_point_off_the_grid():
    cfg = ProfileConfig(endpoints=[{"bucket": "tp1", "url": "http://x"}])
    assert cfg.held_out_point == (8, 1024)
    assert cfg.train_held_out == 512
    assert cfg.longest == 2048 + 32
    with pytest.raises(ValueError, match="grid point"):
        ProfileConfig(endpoints=[{"bucket": "tp1", "url": "http://x"}], held_out=(4, 512))
    with pytest.raises(ValueError, match="between 1 and 2"):
        ProfileConfig(endpoints=[{"bucket": "tp1", "url": "http://x"}], batches=[1, 2])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "no endpoint"),
        (["--endpoint", "tp1"], "expected BUCKET=URL"),
        (["--endpoint", "tp1=localhost:8000"], "must start with http://"),
        (["--endpoint", "tp1=http://x", "--batch", "1,a"], "expected integers"),
        (["--endpoint", "tp1=http://x", "--batch", "4"], "batches"),
        (["--endpoint", "tp1=http://x", "--held-out", "4:512"], "grid point"),
        (["--endpoint", "tp1=http://x", "--held-out", "4"], "BATCH:CONTEXT"),
    ],
)
def test_bad_flags_are_one_line(args, message, capsys):
    assert main(["profile", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_help_names_the_grid_and_the_output(capsys):
    with pytest.raises(SystemExit) as e:
        main(["profile", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--endpoint" in out and "--out" in out and "--held-out" in out


def test_the_tiny_model_profile_matches_its_folder(tiny_model):
    m = load_model(str(tiny_model))
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.intermediate, m.vocab) == (
        TINY.layers, TINY.hidden, TINY.heads, TINY.kv_heads, TINY.intermediate, TINY.vocab,
    )  # fmt: skip
