"""Rollout TP layouts in the training loop's replan: which layouts exist, the order a
change stops and starts instances in, and the decision (scored with the hybrid counts,
hysteresis and gain against the measured restart cost, logged)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from libra.planner import ReplanPolicy, Signals, WorkloadStats, load_hardware, load_model
from libra.planner.replan import ReplanConfig
from libra.planner.settings import PlannerSettings, RolloutSettings
from libra.sim import workloads
from libra.train.planning import Assignment, FleetShape, Replanner, SwitchCosts, Workload, layouts
from libra.train.relayout import plan_moves

BUCKETS = (("short", 1), ("long", 2))
SHAPE = FleetShape(3, 1, 1, tp=1, buckets=BUCKETS, layout=(1, 2))  # 5 core devices
TP = dict(BUCKETS)


def test_layouts_use_every_core_device_and_keep_every_bucket() -> None:
    assert sorted(layouts(SHAPE)) == [(1, 2), (3, 1)]
    wide = FleetShape(5, 1, 0, buckets=(("a", 1), ("b", 2), ("c", 4)), layout=(3, 1, 1))
    got = layouts(wide)  # 9 devices: a + 2b + 4c = 9, each >= 1
    assert sorted(got) == [(1, 2, 1), (3, 1, 1)]
    assert layouts(FleetShape(2, 1, 1)) == [()]  # one TP size: nothing to choose


def test_a_change_stops_only_surplus_instances_and_starts_on_freed_devices() -> None:
    # 3 x TP-1 + 1 x TP-2 -> 1 x TP-1 + 2 x TP-2: two TP-1 stop, then the TP-2 starts
    assert plan_moves(Counter(short=3, long=1), {"short": 1, "long": 2}, TP) == [
        "-short", "-short", "+long"
    ]  # fmt: skip
    # and back: the TP-2 frees two devices, each TP-1 starts as soon as one is free
    assert plan_moves(Counter(short=1, long=2), {"short": 3, "long": 1}, TP) == [
        "-long", "+short", "+short"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="needs 4 devices"):
        plan_moves(Counter(short=3, long=1), {"short": 2, "long": 1}, TP)
    with pytest.raises(ValueError, match="without an instance"):
        plan_moves(Counter(short=3, long=1), {"short": 5, "long": 0}, TP)


def replanner(model: Path, **replan: float) -> Replanner:
    base = PlannerSettings()
    rollout = RolloutSettings(**{**base.rollout.model_dump(), "tp_sizes": [1, 2]})
    return Replanner(
        SHAPE,
        load_model(str(model)),
        load_hardware("h100-80g"),
        base.model_copy(update={"rollout": rollout}),
        ReplanPolicy(ReplanConfig(every_steps=1, cooldown_steps=0, **replan)),
        Assignment(0, 1, (1, 2)),
    )


def work() -> Workload:
    stats = WorkloadStats.from_records(workloads.sample("search-r1", 16, 8, seed=1))
    return Workload(rollout=stats, train=stats)


ROLLOUT_BOUND = Signals(step=3, rollout_s=100.0, train_s=10.0)
COSTS = SwitchCosts(to_train_s=12.0, to_rollout_s=6.0, restart_s=20.0)


def test_a_rollout_bound_step_restarts_instances_at_another_tp(tiny_model: Path) -> None:
    r = replanner(tiny_model, min_gain_fraction=0.01)
    _, _, modelled = r.best(work())
    # the cost model: a model this small decodes faster on three TP-1 instances than on
    # one TP-2 (its all-reduces cost more than the halved weight reads save)
    wide, narrow = modelled[Assignment(0, 1, (1, 2))], modelled[Assignment(0, 1, (3, 1))]
    assert narrow.t_rollout < wide.t_rollout
    decision, target = r.consider(ROLLOUT_BOUND, work(), 50, COSTS) or (None, None)
    assert decision is not None and decision.apply, decision
    assert target == Assignment(0, 1, (3, 1)) and r.current == target
    entry = r.log[-1]
    assert entry["candidate"]["layout"] == {"short": 3, "long": 1}
    assert entry["current"]["layout"] == {"short": 1, "long": 2}
    # two TP-1 instances started: their devices idle one measured restart, over 7 devices
    assert entry["reconfig"]["detail"]["instances_started"] == {"short": 2}
    assert decision.reconfig_cost_s == pytest.approx(2 * 20.0 / 7)
    assert decision.predicted_gain_s > 1.5 * decision.reconfig_cost_s
    assert set(entry["options"]) == {
        "0 shortx3 longx1",
        "1 shortx3 longx1",
        "0 shortx1 longx2",
        "1 shortx1 longx2",
    }


def test_a_layout_gain_below_its_restart_cost_or_inside_the_band_is_not_applied(
    tiny_model: Path,
) -> None:
    r = replanner(tiny_model, min_gain_fraction=0.01)
    costly = SwitchCosts(12.0, 6.0, restart_s=1e4)
    decision, _ = r.consider(ROLLOUT_BOUND, work(), 1, costly) or (None, None)
    assert decision is not None and not decision.apply
    assert "does not exceed cost" in decision.reason
    assert r.current == Assignment(0, 1, (1, 2))
    r = replanner(tiny_model)  # the default band, 5%: a gain of ~2% is inside it
    decision, _ = r.consider(ROLLOUT_BOUND, work(), 50, COSTS) or (None, None)
    assert decision is not None and not decision.apply and "hysteresis" in decision.reason
    assert r.current == Assignment(0, 1, (1, 2))


def test_vllm_fleets_with_two_tp_sizes_replan_their_layout(tiny_model: Path) -> None:
    from libra.train.config import TrainConfig
    from libra.train.setup import make_replanner

    buckets = [{"name": "short", "tp": 1}, {"name": "long", "tp": 2}]
    fleet = {"kind": "vllm", "core_rollout": 4, "hybrids": 0, "buckets": buckets}
    hw = load_hardware("h100-80g")
    r = make_replanner(TrainConfig.model_validate({"fleet": fleet}), tiny_model, hw)
    # the core engines are dealt over the buckets: 2 x TP-1 + 2 x TP-2 on 6 devices
    assert r is not None and r.current == Assignment(0, 0, (2, 2))
    assert sorted(layouts(r.shape)) == [(2, 2), (4, 1)]
    # embedded engines are TP 1 whatever the bucket says: no layout to change, and
    # without hybrids nothing to replan
    embedded = {**fleet, "kind": "embedded"}
    assert make_replanner(TrainConfig.model_validate({"fleet": embedded}), tiny_model, hw) is None
