"""Built-in environments, installed as `libra.envs` (ids in `libra.registry`)."""
