"""OpenAI-compatible inference endpoints grouped in buckets (DESIGN.md)."""

from libra.endpoints.client import Completion
from libra.endpoints.config import BucketConfig, EndpointConfig, SamplingConfig
from libra.endpoints.pool import BucketDown, Endpoint, EndpointPool, Served

__all__ = [
    "BucketConfig",
    "BucketDown",
    "Completion",
    "Endpoint",
    "EndpointConfig",
    "EndpointPool",
    "SamplingConfig",
    "Served",
]
