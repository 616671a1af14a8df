from __future__ import annotations

import re
from pathlib import Path

import pytest

from libra import config
from libra.errors import ConfigError
from libra.rollout.config import RolloutConfig
from tests.conftest import ROOT


def test_load_with_overrides(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('env = "arith"\ngroup_size = 4\n[sampling]\ntemperature = 0.5\n')
    cfg = config.load(RolloutConfig, f, {"group_size": 8, "sampling.max_tokens": 64, "out": None})
    assert (cfg.group_size, cfg.sampling.temperature, cfg.sampling.max_tokens) == (8, 0.5, 64)


def test_errors_name_the_field_path(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[sampling]\ntemperature = -1\n")
    with pytest.raises(
        ConfigError, match=r"c.toml: sampling.temperature: .*greater than or equal to 0 \(got -1\)"
    ):
        config.load(RolloutConfig, f)
    f.write_text("concurency = 3\n")
    with pytest.raises(ConfigError, match="concurency: unknown key"):
        config.load(RolloutConfig, f)
    f.write_text("[[buckets]]\ntp = 2\n")
    with pytest.raises(ConfigError, match=r"buckets.0.name: Field required"):
        config.load(RolloutConfig, f)
    f.write_text("env = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(RolloutConfig, f)
    with pytest.raises(ConfigError, match="not found"):
        config.load(RolloutConfig, tmp_path / "missing.toml")


def test_a_check_across_fields_is_its_own_message_not_the_whole_document() -> None:
    """A model-level check's input is the whole config: the error gave `(top level):
    Value error, ...` and then every key of the file (`libra train --set
    model.hidden_size=127`)."""
    from libra.train import load_config

    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "examples/cpu-train.toml", {"model.hidden_size": 127})
    assert str(err.value).endswith(
        "cpu-train.toml: model.hidden_size (127) must be a multiple of num_attention_heads (2)"
    )


def test_numbers_and_booleans_are_not_coerced_from_other_types(tmp_path: Path) -> None:
    """`group_size = "2"` was read as 2, `steps = true` as 1 and `adapt = "no"` as
    false: a quoted number or a flag in the wrong place ran as something else."""
    from libra.planner import ReplanConfig
    from libra.service.config import SubmitRequest

    f = tmp_path / "c.toml"
    for text, problem in (
        ('group_size = "2"', 'group_size: expected a number, not a string (write 4, not "4")'),
        ("group_size = true", "group_size: expected a number, not true/false"),
        ('[sampling]\ntemperature = "0.5"', "sampling.temperature: expected a number"),
        ("concurrency = false", "concurrency: expected a number, not true/false"),
    ):
        f.write_text(text + "\n")
        with pytest.raises(ConfigError, match=re.escape(f"c.toml: {problem}")):
            config.load(RolloutConfig, f)
    with pytest.raises(ConfigError, match="expected a number"):
        config.build(SubmitRequest, {"env": "arith", "tasks": [{}], "group_size": "4"})
    # what a number field takes as it is: an int for a float, an integral float for an int
    f.write_text("group_size = 4.0\n[sampling]\ntemperature = 1\n")
    cfg = config.load(RolloutConfig, f)
    assert (cfg.group_size, cfg.sampling.temperature) == (4, 1.0)
    assert ReplanConfig(min_gain_fraction=0).min_gain_fraction == 0.0
    assert config.build(SubmitRequest, {"env": "a", "tasks": [{}], "step": None}).step is None


def test_a_boolean_field_takes_true_or_false_only() -> None:
    from libra.train import load_config

    for value in (0, "no", "false"):
        with pytest.raises(ConfigError, match="planner.adapt: expected true or false"):
            load_config(ROOT / "examples/cpu-train.toml", {"planner.adapt": value})
    assert (
        load_config(ROOT / "examples/cpu-train.toml", {"planner.adapt": False}).planner.adapt
        is False
    )
