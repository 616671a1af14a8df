"""What the `libra train` tests share."""

from libra.bench.train_ray import TINY_MODEL

__all__ = ["TINY_MODEL"]
