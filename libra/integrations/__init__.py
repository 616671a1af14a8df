"""Adapters that put Libra under other projects' trainers and environments.

- `libra.integrations.trl`: a `rollout_func` for TRL's `GRPOTrainer`, backed by
  `libra serve-rollout`, and the callback that publishes the trained weights to it.
- `libra.integrations.verifiers`: verifiers 0.4 environments as Libra envs
  (`--env verifiers:TASKSET`), their model calls through Libra's proxy.

Each adapter imports its project only when used (an optional extra).
"""
