"""A hybrid replica whose process is gone (its node lost, a crash) while it starts or
waits to join: `remove_hybrid` drops it instead of failing the driver, and the core
trains on. Real rank processes (`ElasticTrainer` on this machine)."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

from libra.trainer import ElasticTrainer, TrainerConfig
from tests.integration.test_elastic_helpers import micro_model
from tests.integration.test_elastic_trainer import records


def kill_replica(rid: str) -> None:
    """SIGKILL the rank process of replica `rid`, as a lost node does."""
    [p] = [p for p in multiprocessing.active_children() if p.name == f"libra-{rid}-0"]
    p.kill()
    p.join()


def test_a_hybrid_gone_while_starting_or_waiting_is_dropped_on_removal(tmp_path: Path) -> None:
    cfg = TrainerConfig(
        model=str(micro_model(tmp_path / "m")),
        elastic={"core_replicas": 1, "timeout_s": 30},
    )
    with ElasticTrainer(cfg) as trainer:
        trainer.add_hybrid("h0")
        kill_replica("h0")  # before it reported ready
        trainer.remove_hybrid("h0")
        state = {r.id: r.state for r in trainer.replicas()}
        assert state["h0"] == "dropped"

        trainer.add_hybrid("h1")
        deadline = time.monotonic() + 300
        while {r.id: r.state for r in trainer.replicas()}["h1"] != "waiting":
            assert time.monotonic() < deadline, "h1 never started"
            time.sleep(0.2)
        kill_replica("h1")  # registered, not yet admitted
        trainer.remove_hybrid("h1")
        assert {r.id: r.state for r in trainer.replicas()}["h1"] == "dropped"

        rep = trainer.step(records(0, vocab=256))  # the core trains on, alone
        assert rep.version == 1 and rep.tokens > 0
        assert {e.replica for e in rep.events if e.kind == "dropped"} == {"h0", "h1"}
