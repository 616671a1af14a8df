"""The asyncio episode engine: episodes, batches, sinks, and `rollout()`."""

from libra.rollout.config import LimitsConfig, RolloutConfig
from libra.rollout.episode import EpisodeRunner, EpisodeSpec
from libra.rollout.run import rollout, run_sync

__all__ = ["EpisodeRunner", "EpisodeSpec", "LimitsConfig", "RolloutConfig", "rollout", "run_sync"]
