"""Issue #16: where Libra lost to a static split in the simulator.

- A spilled episode (placed on a larger bucket than the policy chose, because that
  bucket had room) is not moved back down: the policy is told the bucket it routed the
  episode to, as a live engine would tell it, so it never prices a re-prefill "down" from
  a bucket it did not choose.
"""

from __future__ import annotations

from libra.planner import instance_cost, load_hardware, load_model
from libra.routing import Bucket, EpisodeState
from libra.sim.episodes import Episode
from libra.sim.fleet import Fleet
from libra.sim.loop import Loop

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
