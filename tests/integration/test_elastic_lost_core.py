"""A core replica lost between two steps (its node gone while rollouts run) ends the
run, but a hybrid that trained up holds the same state: the checkpoint is saved from
it, and the resume starts from the step the loss happened at, not from the last
periodic checkpoint. Real rank processes (`ElasticTrainer` on this machine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra.errors import TrainerError
from libra.trainer import ElasticTrainer, TrainerConfig
from libra.trainer.checkpoint import read_meta
from tests.integration.test_elastic_helpers import micro_model
from tests.integration.test_elastic_lost_hybrid import kill_replica
from tests.integration.test_elastic_trainer import records


def test_a_lost_core_replicas_state_is_saved_from_a_trained_up_hybrid(tmp_path: Path) -> None:
    cfg = TrainerConfig(
        model=str(micro_model(tmp_path / "m")),
        grpo={"minibatches": 2},  # the step's shares are answered after old logprobs
        elastic={"core_replicas": 1, "timeout_s": 30},
    )
    ckpt = tmp_path / "ckpt"
    with ElasticTrainer(cfg) as trainer:
        trainer.add_hybrid("h0")
        for s in range(400):
            rep = trainer.step(records(s, vocab=256))
            if any(e.kind == "joined" for e in rep.events):
                break
        trainer.step(records(1000, vocab=256))  # h0 trains a whole step with the core
        hashes = trainer.state_hashes()
        assert hashes["core0"] == hashes["h0"]
        assert trainer.holder() == "core0"
        version = trainer.version

        kill_replica("core0")  # between two steps, as a lost node
        with pytest.raises(TrainerError, match="core replica core0"):
            trainer.step(records(1001, vocab=256))
        assert trainer.version == version
        assert trainer.holder() == "h0"
        trainer.save_checkpoint(str(ckpt))  # h0 still owed the cut-short step's reply
        assert trainer.state_hashes()["h0"] == hashes["h0"]  # and answers in turn

    assert read_meta(ckpt)["version"] == version
    with ElasticTrainer(cfg, resume=str(ckpt)) as resumed:
        assert resumed.version == version
        assert resumed.state_hashes()["core0"] == hashes["core0"]  # bit for bit


def test_without_a_trained_up_replica_nothing_is_saved(tmp_path: Path) -> None:
    cfg = TrainerConfig(
        model=str(micro_model(tmp_path / "m")), elastic={"core_replicas": 1, "timeout_s": 30}
    )
    with ElasticTrainer(cfg) as trainer:
        trainer.step(records(0, vocab=256))
        kill_replica("core0")
        with pytest.raises(TrainerError, match="core replica core0"):
            trainer.step(records(1, vocab=256))
        assert trainer.holder() is None
        with pytest.raises(TrainerError, match="no live replica holds the state of step 1"):
            trainer.save_checkpoint(str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()
