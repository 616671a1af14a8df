"""The envs a service hosts, and one routing policy per env (shared by its batches, so
C-MLFQ learns from every batch of that env)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from libra import registry
from libra.env import Env
from libra.errors import ConfigError, LibraError
from libra.rollout.run import load_env, make_policy
from libra.routing.base import Bucket, RoutingPolicy
from libra.service.config import EnvEntry
from libra.service.errors import RequestError


class EnvHost:
    """Configured envs are loaded at start (a bad one stops the service with one line);
    without any, every registered env id is hosted and loaded on first use. Paths
    (`file.py:Class`) are never loaded on a client's say-so: list them in the config."""

    def __init__(
        self,
        entries: Sequence[EnvEntry],
        buckets: Sequence[Bucket],
        policy: str,
        routing: dict[str, Any],
    ):
        self._buckets = list(buckets)
        self._policy_name = policy
        self._routing = routing
        self._envs: dict[str, Env] = {}
        self._policies: dict[str, RoutingPolicy] = {}
        self._specs: dict[str, EnvEntry] = {}
        for e in entries:
            if e.key in self._specs:
                raise ConfigError(
                    f"envs: the name {e.key!r} is configured twice; give one a `name`"
                )
            self._specs[e.key] = e
        self.lazy = not entries
        if self.lazy:
            self._specs = {k: EnvEntry(spec=k) for k in registry.envs.known()}
        else:
            for name in self._specs:
                self._load(name)

    def names(self) -> list[str]:
        return sorted(self._specs)

    def entries(self) -> list[EnvEntry]:
        """Every env this service hosts, as configured (or registered, when lazy)."""
        return list(self._specs.values())

    def get(self, name: str) -> Env:
        if name not in self._specs:
            raise RequestError(
                400, f"unknown env {_cut(name)!r}; this service hosts: {', '.join(self.names())}"
            )
        if name not in self._envs:
            try:
                self._load(name)
            except LibraError as e:
                raise RequestError(500, f"env {name!r} cannot be loaded here: {e}") from None
        return self._envs[name]

    def policy(self, name: str) -> RoutingPolicy:
        self.get(name)
        return self._policies[name]

    def _load(self, name: str) -> None:
        entry = self._specs[name]
        self._envs[name] = load_env(entry.spec, entry.options)
        self._policies[name] = make_policy(self._policy_name, self._buckets, self._routing)


def _cut(name: str, keep: int = 100) -> str:
    """A client's env name as an error echoes it: at most `keep` characters."""
    return name if len(name) <= keep else f"{name[:keep]}... ({len(name):,} characters)"


__all__ = ["EnvHost"]
