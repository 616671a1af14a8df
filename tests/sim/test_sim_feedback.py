"""Issue #16: where Libra lost to a static split in the simulator.

- A spilled episode (placed on a larger bucket than the policy chose, because that
  bucket had room) is not moved back down: the policy is told the bucket it routed the
  episode to, as a live engine would tell it, so it never prices a re-prefill "down" from
  a bucket it did not choose.
- The replanner predicts each layout with the factors (measured / modelled) that layout
  measured, and moves to the best uniform-TP plan when the heterogeneous plan measured
  slower than its model says; a change that measured slower than the layout it replaced
  is reverted.
"""

from __future__ import annotations

import math

import pytest

from libra.errors import ConfigError
from libra.planner import instance_cost, load_hardware, load_model, plan
from libra.planner.measured import Timed
from libra.routing import Bucket, EpisodeState
from libra.sim.cluster import Simulation
from libra.sim.config import SimConfig
from libra.sim.control import Replanner
from libra.sim.episodes import Episode
from libra.sim.fleet import Fleet
from libra.sim.layout import Env, Layout
from libra.sim.loop import Loop
from libra.sim.runner import build_env
from libra.sim.systems import SYSTEMS
from tests.sim.runs import run

MODEL, HW = load_model("qwen3-14b"), load_hardware("a800-80g")
SMALL, LARGE = Bucket("tp1", 1, 8_000), Bucket("tp8", 8, 40_960)


class Always:
    """A routing policy that starts every episode in the smallest bucket and after each
    tool return answers `to` (C-MLFQ predicting the episode short: the smallest; long:
    the largest); it records the bucket it was told the episode is in."""

    name = "always"

    def __init__(self, to: Bucket) -> None:
        self.to, self.told = to, []  # type: list[str]

    def on_start(self, state: EpisodeState) -> str:
        return SMALL.name

    def on_tool_return(self, state: EpisodeState) -> str:
        self.told.append(state.bucket)
        return self.to.name

    def on_finish(self, record: object) -> None:
        return None


def episode(i: int) -> Episode:
    turn = {"model_tokens": 200, "tool_tokens": 50,
            "tool_returns": [{"tool": "search", "payload_tokens": 50, "latency_s": 1.0}]}  # fmt: skip
    return Episode.from_data(
        {"task_id": f"t{i}", "prompt_tokens": 300, "turns": [turn, turn, {"model_tokens": 100}]}
    )


def fleet_of(policy: Always, ready: dict[int, float]) -> tuple[Loop, Fleet, list[float]]:
    loop = Loop()
    costs = {tp: instance_cost(MODEL, HW, tp) for tp in ready}
    done: list[float] = []
    fleet = Fleet(loop, costs, 256, lambda run, now: done.append(now))
    fleet.set_routing([SMALL, LARGE], policy)  # type: ignore[arg-type]
    for tp, at in ready.items():
        fleet.add(tp, at)
    loop.run(lambda: False, horizon=0.0)  # the instances ready at 0 come up
    return loop, fleet, done


def test_a_spilled_episode_is_not_moved_back_down():
    policy = Always(SMALL)
    loop, fleet, done = fleet_of(policy, {1: 0.0, 8: 0.0})
    n = 40
    for i in range(n):
        fleet.start(episode(i), 0, 0.0)
    loop.run(lambda: len(done) >= n)
    assert len(done) == n
    # Least-loaded per GPU: most episodes spilled to the TP-8 instance. The policy
    # routed every one to the small bucket and is told so after each tool return, so
    # its "small" is no move; before, it was told "tp8" and each spilled episode
    # re-prefilled its context on the TP-1 instance.
    assert sum(1 for i in fleet.instances if i.tp == 8 and i.busy_s > 0) == 1
    assert set(policy.told) == {SMALL.name}
    assert fleet.moves["policy"] == 0
    assert fleet.reprefill_tokens == 0


def test_the_policy_still_moves_an_episode_up():
    policy = Always(LARGE)
    loop, fleet, done = fleet_of(policy, {1: 0.0, 8: 0.0})
    fleet.start(episode(0), 0, 0.0)  # alone: the TP-1 instance takes it (a tie)
    loop.run(lambda: len(done) >= 1)
    assert policy.told[0] == SMALL.name
    assert fleet.moves["policy"] == 1


def layouts(env: Env) -> tuple[Layout, Layout]:
    stats = env.stats(0)
    return env.planned(stats, hetero=True, step=0), env.planned(stats, hetero=False, step=0)


def test_the_replanner_leaves_a_plan_that_measured_slower_than_modelled():
    """dapo-math on 48 GPUs: C-MLFQ's rollout on the planner's heterogeneous plan
    measures well above the model (which assumes every length on its ideal instance
    type); the calibrated prediction moves Libra to a single-bucket plan (the uniform-TP
    split, or the time-shared plan)."""
    env = build_env(SimConfig(workload="dapo-math", gpus=48, steps=8, seed=0))
    hetero, uniform = layouts(env)
    shared = env.planned(env.stats(0), hetero=False, step=0, colocated=True)
    assert len(hetero.mix) > 1 and len(uniform.mix) == 1
    sim = Simulation(SYSTEMS["libra-cmlfq"], env, layout=hetero)
    sim.run()
    ctl = sim.controller
    assert isinstance(ctl, Replanner)
    assert len(sim.layout.mix) == 1
    first = sim.decisions[0]
    single = (uniform.describe()["rollout"], shared.describe()["rollout"])
    assert first["apply"] and first["candidate"]["rollout"] in single
    assert first["calibration"]["rollout"] > 1.1  # measured well above the model


def test_a_change_that_measured_slower_is_reverted(monkeypatch):
    """The candidate the replanner moves to is made to measure slower than the layout it
    left (a uniform plan on half the cluster, its model flattered 3x until it has run):
    once it has run a step wholly, the replanner moves back (a revert)."""
    env = build_env(SimConfig(workload="dapo-math", gpus=48, steps=8, seed=0))
    hetero = env.planned(env.stats(0), hetero=True, step=0)
    half = Layout.of_plan(plan(MODEL, HW, env.stats(0), 24), env.max_context)
    real_predict = Replanner.predict
    first = hetero

    def planned(self, stats, *, hetero, step=None, colocated=False):
        if colocated:
            raise ConfigError("the two layouts of this test only")
        return first if hetero else half  # the same two layouts at every replan

    def predict(self, layout, *args):
        t, f = real_predict(self, layout, *args)
        if Replanner.key(layout) == Replanner.key(half) and self.calib.own(self.key(half)) is None:
            return Timed(t.t_train / 3, t.t_rollout / 3), f
        return t, f

    monkeypatch.setattr(Env, "planned", planned)
    monkeypatch.setattr(Replanner, "predict", predict)
    sim = Simulation(SYSTEMS["libra-cmlfq"], env, layout=hetero)
    sim.run()
    applied = [d for d in sim.decisions if d["apply"]]
    assert len(applied) == 2, sim.decisions
    assert applied[0]["candidate"]["rollout"] == half.describe()["rollout"]
    assert applied[1].get("revert") and applied[1]["trigger"] in ("check", "imbalance")
    assert Replanner.key(sim.layout) == Replanner.key(hetero)


def test_a_batch_that_outgrows_the_training_configuration_is_priced_as_a_restart():
    """Qwen3-32B's training configuration is sized to the longest sequence of the batch
    it was planned on; a later batch with a longer one restarts the trainer on the best
    configuration that fits (as for every system). The replanner prices staying as that
    configuration, not as a layout that cannot run (which forced a move at any cost:
    Libra lost 1-7% to the static split it started on, docs/simulation.md)."""
    cfg = SimConfig(
        workload="search-r1-causal", gpus=32, steps=4, seed=0, model="qwen3-32b",
        hardware="h100-80g",
    )  # fmt: skip
    env = build_env(cfg)
    start = env.planned(env.stats(0), hetero=False, step=0)
    sim = Simulation(SYSTEMS["libra-homogeneous"], env, layout=start)
    sim.run()
    assert sim.trainer.restarts >= 1  # a batch outgrew the configuration
    assert sim.layout.train == sim.trainer.config
    assert sim.decisions
    for d in sim.decisions:
        assert math.isfinite(d["current_t_iter"]), d["reason"]
        assert "cannot run" not in d["reason"]


def test_a_restart_a_batch_forced_is_not_taken_for_the_configuration_s_speed():
    """search-r1, Qwen3-30B-A3B on 64 H200s, seed 17 (a probe cell): Libra starts
    time-shared, and batch 2 outgrows the training configuration, so the trainer
    restarts on one that fits (one minute, as in every system). That step's training
    (74 s, 13.5 s of it training) had calibrated the new configuration 5.5 times slower
    than it is; Libra moved back to the old one at the next step (another restart),
    the batch after outgrew it again, and it lost 2.4% to the layout it never left
    (verl-colocated). A forced restart is now left out of the step's measured training
    time, as a change's restart already was."""
    cfg = SimConfig(workload="search-r1", gpus=64, steps=10, seed=17, model="qwen3-30b-a3b",
                    hardware="h200-141g")  # fmt: skip
    env = build_env(cfg)
    colocated, libra = run(env, "verl-colocated"), run(env, "libra")
    assert colocated.trainer.restarts == 1  # the batch that outgrew the configuration
    assert libra.trainer.restarts == 1, libra.decisions
    assert libra.t_end[-1] <= colocated.t_end[-1] * 1.001


def test_a_training_configuration_a_batch_outgrew_is_not_a_candidate_again():
    """dapo-math, Qwen3-30B-A3B on 24 H200s, seed 95, 30 steps: Libra moves to the
    time-shared layout at step 6 and the next batch outgrows its training configuration
    (the trainer restarts on one that fits). At step 23 the planner, sized on that
    batch, offered the outgrown configuration again as 15 s a step faster; Libra took
    it, the next batch outgrew it again, and the two restarts left it 1.7% behind
    verl-colocated. The lengths that forced a restart come back, so a configuration the
    trainer was forced off is not a candidate for the rest of the run."""
    cfg = SimConfig(workload="dapo-math", gpus=24, steps=30, seed=95, model="qwen3-30b-a3b",
                    hardware="h200-141g")  # fmt: skip
    env = build_env(cfg)
    libra, colocated = run(env, "libra"), run(env, "verl-colocated")
    assert isinstance(libra.controller, Replanner)
    assert libra.controller.outgrown  # a batch outgrew a configuration it chose
    assert libra.trainer.restarts == 2, libra.decisions  # the move, and that batch
    assert libra.t_end[-1] <= colocated.t_end[-1] / 0.99


def test_the_first_periodic_replan_comes_after_the_pilots_not_inside_them():
    """search-r1, Qwen3-32B on 32 A800s, seed 99, staleness 2: rollout and training stay
    within the imbalance band, so only the periodic trigger starts a decision. It is
    due at once; asked (and so spent) on step 0, whose decision the pilots' evidence
    overrules, it came back only ten steps later, never in a 10-step run. As in `libra
    train`, the trigger is asked once the guards pass: the first decision is on the
    first batch after the pilots."""
    cfg = SimConfig(workload="search-r1", gpus=32, steps=10, seed=99, model="qwen3-32b",
                    hardware="a800-80g", staleness=2)  # fmt: skip
    libra = run(build_env(cfg), "libra")
    assert isinstance(libra.controller, Replanner)
    first = libra.decisions[0]
    assert (first["step"], first["trigger"]) == (libra.controller.piloted, "periodic")


@pytest.mark.xfail(
    strict=True,
    reason="open (#16): layouts ranked on three batches (the pilots) or on one (a "
    "move); docs/simulation.md, 'A move made on one batch' and 'The tail's batch'",
)
def test_a_move_made_on_one_batch_does_not_lose_to_the_split_it_left():
    """dapo-math, qwen3-4b on 16 H200s, seed 34: on batch 4 (a heavy one) the time-shared
    layout replayed 16% faster than the running split, and Libra moved to it; on the
    next five batches its iterations were 7-9% longer, and Libra lost 3.4% to the split
    it left (areal-static-optimal). Known and open: confirming moves on the last four
    batches fixed this cell and cost others more (docs/simulation.md). Since the pilots
    take a restart out of the iteration it delayed (da898bc), Libra starts on the
    time-shared layout instead (its pilot 1,869 s against the split's 1,916 s; they ran
    1,963 and 1,881 s) and loses 4.2%: the same forecast from a few batches."""
    cfg = SimConfig(workload="dapo-math", gpus=16, model="qwen3-4b", hardware="h200-141g",
                    steps=10, seed=34)  # fmt: skip
    env = build_env(cfg)
    libra = Simulation(SYSTEMS["libra"], env)
    libra.run()
    static = Simulation(SYSTEMS["areal-static-optimal"], env)
    static.run()
    assert static.t_end[-1] >= 0.99 * libra.t_end[-1], libra.decisions
