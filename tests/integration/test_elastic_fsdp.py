"""2-rank replicas (FSDP2 `fully_shard` over each replica's own gloo group): a core
replica of two ranks and a hybrid of two ranks, through two join/leave cycles."""

from __future__ import annotations

import pytest

from libra.trainer.rendezvous import host_store
from libra.trainer.scenario import MemberPlan
from tests.integration.test_elastic_helpers import config, micro_model, run_scenario


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fsdp")
    model = micro_model(d / "model")
    store = host_store()
    cfg = config(model, timeout_s=60, replica_ranks=2, snapshot_rate_mb_s=0.1)
    common = {"core_ids": ["c0"], "config": cfg, "port": store.port, "size": 2}
    plans = [
        MemberPlan(id="c0", kind="core", rank=k, log=str(d / f"c0-{k}.jsonl"), **common)
        for k in range(2)
    ] + [
        MemberPlan(
            id="h0",
            kind="hybrid",
            rank=k,
            log=str(d / f"h0-{k}.jsonl"),
            cycles=2,
            ready_updates=3,
            idle_updates=2,
            **common,
        )
        for k in range(2)
    ]
    return run_scenario(plans, timeout=900)


def test_sharded_replicas_stay_bit_identical_through_join_leave_cycles(logs):
    for k in range(2):
        hybrid = {r["update"]: r for r in logs[f"h0-{k}"] if r["applied"]}
        core = {r["update"]: r for r in logs[f"c0-{k}"]}
        assert len(hybrid) >= 8
        for u, r in hybrid.items():
            assert r["hash"] == core[u]["hash"], f"rank {k} differs at update {u}"
    # the two shards of one replica hold different halves
    assert logs["c0-0"][-1]["hash"] != logs["c0-1"][-1]["hash"]


def test_both_ranks_of_a_replica_agree_on_membership(logs):
    for rid in ("c0", "h0"):
        a, b = logs[f"{rid}-0"], logs[f"{rid}-1"]
        keys = ("update", "applied", "contributed", "epoch", "tokens", "became_ready", "left")
        assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    h = logs["h0-0"]
    assert sum(r["became_ready"] for r in h) == 2 and sum(r["left"] for r in h) == 2
    assert any(not r["applied"] for r in h)  # caught up while the core trained
