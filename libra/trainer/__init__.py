"""The elastic GRPO trainer: the only layer of Libra that imports torch at module level.

    from libra.trainer import ElasticTrainer, TrainerConfig

    with ElasticTrainer(TrainerConfig(model="path/to/model")) as trainer:
        report = trainer.step(records)        # list[libra.Trajectory] -> StepReport
        trainer.add_hybrid("h0")              # joins live, catches up from a snapshot
        trainer.remove_hybrid("h0")           # leaves after the next update
        trainer.save_weights("out/v1")        # an HF folder engines load (libra.weights)

See docs/grpo.md (the loss) and docs/elastic.md (membership, snapshots, failures).
"""

from libra.errors import ReplicaDropped, TrainerError
from libra.trainer.config import ElasticConfig, GRPOConfig, OptimConfig, TrainerConfig
from libra.trainer.report import MembershipEvent, ReplicaStatus, StepReport
from libra.trainer.samples import Sample, group_advantages, prepare
from libra.trainer.trainer import ElasticTrainer

Dropped = ReplicaDropped
"""`ReplicaDropped`'s name before the trainer's errors joined `libra.errors`; kept so
code that imported it from here goes on working."""

__all__ = [
    "Dropped",
    "ElasticConfig",
    "ElasticTrainer",
    "GRPOConfig",
    "MembershipEvent",
    "OptimConfig",
    "ReplicaDropped",
    "ReplicaStatus",
    "Sample",
    "StepReport",
    "TrainerConfig",
    "TrainerError",
    "group_advantages",
    "prepare",
]
