"""A hybrid that crashes or hangs is dropped and the core trains on.

Gloo cannot abort a collective: a crashed peer fails the all-reduce at once (its
sockets close), a hung one only at the group's timeout, which bounds the core's stall.

The signal is sent `KILL_LATE_S` after its condition holds, as a loaded machine may
send it (issue 14: at load 4-7 the core once finished its updates before the kill
landed, and no drop was seen). So the core has no fixed last update: once the signal is
sent, `stop_at` is set a few updates ahead of the core's progress, and the drop, which
comes at the first all-reduce after the signal, always falls before it.
"""

from __future__ import annotations

import signal
import time

from libra.trainer.rendezvous import connect, host_store
from libra.trainer.scenario import MemberPlan
from tests.integration.test_elastic_helpers import config, micro_model, run_scenario

TIMEOUT_S = 8.0
KILL_LATE_S = 2.0
AFTER_KILL = 12
"""Updates the core runs after the signal (the drop is at the first or second)."""


def _late(condition):
    def check(rows) -> bool:
        if not condition(rows):
            return False
        time.sleep(KILL_LATE_S)
        return True

    return check


def _run(d, *, kill_when, sig, rate=None):
    model = micro_model(d / "model")
    store = host_store()
    cfg = config(model, timeout_s=TIMEOUT_S, report_window_s=1.0, snapshot_rate_mb_s=rate)
    # max_updates only caps a broken run: the core stops AFTER_KILL updates after the kill.
    common = {"core_ids": ["c0"], "config": cfg, "port": store.port, "size": 1,
              "max_updates": 5000}  # fmt: skip
    plans = [
        MemberPlan(
            id="c0", kind="core", rank=0, log=str(d / "c0.jsonl"), await_hybrids=1, **common
        ),
        MemberPlan(
            id="h0",
            kind="hybrid",
            rank=0,
            log=str(d / "h0.jsonl"),
            cycles=1,
            ready_updates=1000,
            **common,
        ),
    ]

    members = connect("127.0.0.1", store.port, "libra")  # the keys the members use

    def stop_soon() -> None:
        members.set("stop_at", str(int(bytes(members.get("progress"))) + AFTER_KILL))

    return run_scenario(
        plans, timeout=900, kill=("h0-0", _late(kill_when), sig), after_kill=stop_soon
    )


def _after_drop(core: list[dict]) -> tuple[dict, list[dict]]:
    drops = [r for r in core if r["dropped"]]
    assert len(drops) == 1 and drops[0]["dropped"] == ["h0"]
    i = core.index(drops[0])
    return drops[0], core[i + 1 :]


def test_joiner_killed_mid_snapshot_is_dropped_and_core_continues(tmp_path):
    # A slow snapshot (0.05 MB/s of ~0.3 MB): kill the joiner after two zero updates.
    logs = _run(
        tmp_path,
        rate=0.05,
        sig=signal.SIGKILL,
        kill_when=lambda rows: sum(not r["applied"] for r in rows) >= 2,
    )
    h = logs["h0-0"]
    assert not any(r["applied"] for r in h)  # it never caught up: killed mid-snapshot
    core = logs["c0-0"]
    drop, after = _after_drop(core)
    assert drop["applied"] and drop["members"] == ["c0"]  # the same update, redone alone
    assert drop["timings"]["recover_s"] < TIMEOUT_S  # a crash is seen at once
    assert [r["update"] for r in core] == list(range(1, core[-1]["update"] + 1))
    assert core[-1]["update"] >= drop["update"] + AFTER_KILL - 2  # trained on to the end
    assert after and all(r["applied"] and r["members"] == ["c0"] for r in after)


def test_hung_hybrid_is_dropped_after_the_timeout(tmp_path):
    # SIGSTOP a ready hybrid: the core's all-reduce waits out the gloo timeout.
    logs = _run(
        tmp_path,
        sig=signal.SIGSTOP,
        kill_when=lambda rows: sum(r["contributed"] for r in rows) >= 2,
    )
    core = logs["c0-0"]
    drop, after = _after_drop(core)
    waited = drop["timings"]["allreduce_s"] + drop["timings"]["recover_s"]
    assert waited >= TIMEOUT_S * 0.9  # bounded below by the timeout: gloo cannot abort ...
    assert drop["timings"]["total_s"] < TIMEOUT_S + 1.0 + 60  # ... and above by it (+ slack)
    assert after and all(r["applied"] for r in after)
    hashes = {r["update"]: r["hash"] for r in logs["h0-0"] if r["applied"]}
    assert hashes and all(hashes[u] == core[u - 1]["hash"] for u in hashes)


def test_a_member_admitted_that_never_arrives_is_dropped(tmp_path):
    """A hybrid admitted after its last message, whose process then died (its node lost
    between two updates; seen in CI on a Ray cluster): the next epoch's group cannot
    form. The core's build of it times out, a recovery drops the member, and the core
    trains on instead of failing. Here the member is a registration nobody will serve
    (an id, an address that refuses connections), admitted at the first update."""
    import json

    model = micro_model(tmp_path / "model")
    store = host_store()
    cfg = config(model, timeout_s=TIMEOUT_S, report_window_s=1.0)
    members = connect("127.0.0.1", store.port, "libra")
    ticket = int(members.add("tickets", 1))
    members.set(f"ticket/{ticket}", json.dumps({"id": "gone", "addrs": ["127.0.0.1:9"],
                                                "ranks": 1}))  # fmt: skip
    plan = MemberPlan(id="c0", kind="core", rank=0, size=1, core_ids=["c0"], config=cfg,
                      port=store.port, log=str(tmp_path / "c0.jsonl"), max_updates=6)  # fmt: skip
    core = run_scenario([plan], timeout=600)["c0-0"]
    assert [r["update"] for r in core] == list(range(1, 7))  # trained on to the end
    drops = [r for r in core if r["dropped"]]
    assert [r["dropped"] for r in drops] == [["gone"]]
    assert drops[0]["applied"] and drops[0]["members"] == ["c0"]
    assert drops[0]["timings"]["wait_group_s"] >= TIMEOUT_S * 0.9  # the build's timeout
    assert all(r["applied"] for r in core)
