"""`libra train` settings that validated but ran wrong, or failed only after the warm
start: each is one error at load (or a problem of the dry run), or drives what it
names."""

from __future__ import annotations

import pytest

from libra.errors import ConfigError
from libra.record import Trajectory, Turn
from libra.train import load_config
from libra.train.groups import Group, Tally
from tests.conftest import ROOT

CONFIG = ROOT / "examples/cpu-train.toml"


def test_fleet_core_train_is_the_one_count_of_core_replicas() -> None:
    """`fleet.core_train = 2` showed two training workers while the trainer built one
    replica (it read `trainer.elastic.core_replicas`); the reverse trained on two while
    the display and the planner said one."""
    assert load_config(CONFIG, {"fleet.core_train": 2}).trainer.elastic.core_replicas == 2
    with pytest.raises(ConfigError, match=r"core_replicas \(2\) differs from fleet.core_train"):
        load_config(CONFIG, {"trainer.elastic.core_replicas": 2})


def test_replicas_the_trainer_cannot_admit_and_buckets_without_engines_are_refused() -> None:
    """A hybrid sent to train past `max_replicas` waited for ever, and a bucket no engine
    serves made every episode an error: both runs ended `done`, exit 0."""
    with pytest.raises(ConfigError, match=r"max_replicas \(1\) is below fleet.core_train"):
        load_config(CONFIG, {"trainer.elastic.max_replicas": 1})
    two = [{"name": "a", "bound": 64}, {"name": "b", "bound": 1024}]
    with pytest.raises(ConfigError, match="fleet.buckets: b would have no engine"):
        load_config(CONFIG, {"fleet.buckets": two})
    assert (
        len(load_config(CONFIG, {"fleet.buckets": two, "fleet.core_rollout": 2}).fleet.buckets) == 2
    )


def test_bucket_bounds_that_cannot_resolve_are_a_dry_run_problem() -> None:
    """Two buckets without a bound at a context of 1,024 both took 1,024: an error only
    once the warm start had run (minutes)."""
    from libra.train.dryrun import describe

    two = [{"name": "a"}, {"name": "b"}]
    doc = describe(load_config(CONFIG, {"fleet.buckets": two, "fleet.core_rollout": 2}))
    assert any("fleet.buckets: bucket bounds must differ" in p for p in doc["problems"])


def test_an_episode_truncated_before_its_first_token_counts_as_failed() -> None:
    """With prompts past the model's context every episode ended `truncated` with no
    token, the failure guard counted none of them, and the run ended `done` having
    trained on nothing."""

    def rec(status: str, model_tokens: int) -> Trajectory:
        turns = [Turn(start=0, model_tokens=model_tokens, tool_tokens=0, bucket="tp1",
                      endpoint="u", policy_version=0)] if model_tokens else []  # fmt: skip
        return Trajectory(id=f"b/t/{status}{model_tokens}", batch_id="b", task_id="t",
                          group_id="b/t", env="e", step=0, status=status, turns=turns,
                          error="prompt of 352 tokens does not fit the context of 64")  # fmt: skip

    tally = Tally()
    tally.add(Group("t", {}, 0, 3, [rec("truncated", 0), rec("truncated", 5), rec("ok", 7)]))
    assert tally.episodes == 3
    assert tally.errors == {"prompt of 352 tokens does not fit the context of 64": 1}
