"""Membership epochs and the control slots carried on the gradient all-reduce. Pure.

An *epoch* is a fixed list of member replicas with one cross-replica process group per
shard index. Every member derives the next epoch from the same inputs (the current
epoch, the summed control slots of one all-reduce, the join records in the store), so
all of them agree on it without another round of messages; the coordinator also
writes it to the store for joiners, who have no previous epoch.

Control slots (float32, appended to the flattened gradient, summed like it):

    tok_hi, tok_lo      loss tokens as hi * 4096 + lo (each sum exact in float32)
    samples             samples trained on
    metrics...          per-token sums (`grpo.METRICS`)
    admit               replicas the coordinator admits with this update (others send 0)
    leave[k]            1 from replica slot k: it leaves after this update
    ready[k]            1 from replica slot k: its state is current (it can donate)

Only a replica's shard-0 rank writes admit / leave / ready, so sums are 0 or 1 each.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Literal

from libra.trainer.grpo import METRICS

_LO = 4096


@dataclass(frozen=True, slots=True)
class Member:
    """A replica in an epoch."""

    id: str
    kind: Literal["core", "hybrid"]
    ticket: int = 0
    """Join ticket (0 for core replicas)."""
    addrs: tuple[str, ...] = ()
    """host:port per rank where a hybrid receives its snapshot."""


@dataclass(frozen=True, slots=True)
class Epoch:
    number: int
    name: str
    """Store prefix of this epoch's groups: `e{n}`, or `e{n}-r{k}` after recovery k."""
    start: int
    """First optimizer update run in this epoch."""
    members: tuple[Member, ...]
    ready: frozenset[str]
    """Members whose state is current when the epoch starts."""
    donors: tuple[tuple[str, str], ...] = ()
    """(member, donor) pairs new in this epoch: the donor streams its state at `start`."""
    recoveries: int = 0
    """Failures recovered from so far (names the next recovery's store keys)."""

    def slot(self, member_id: str) -> int:
        for k, m in enumerate(self.members):
            if m.id == member_id:
                return k
        raise KeyError(member_id)

    def member(self, member_id: str) -> Member:
        return self.members[self.slot(member_id)]

    def ids(self) -> list[str]:
        return [m.id for m in self.members]

    def donor_of(self, member_id: str) -> str | None:
        return dict(self.donors).get(member_id)

    def recipients(self, donor_id: str) -> list[str]:
        return [j for j, d in self.donors if d == donor_id]

    def to_json(self) -> str:
        d = asdict(self)
        d["ready"] = sorted(self.ready)
        return json.dumps(d)

    @classmethod
    def from_json(cls, s: str | bytes) -> Epoch:
        d = json.loads(s)
        members = tuple(
            Member(m["id"], m["kind"], m["ticket"], tuple(m["addrs"])) for m in d["members"]
        )
        return cls(
            number=d["number"], name=d["name"], start=d["start"], members=members,
            ready=frozenset(d["ready"]), donors=tuple(tuple(p) for p in d["donors"]),
            recoveries=d["recoveries"],
        )  # fmt: skip


def assign_donors(
    members: tuple[Member, ...], ready: set[str], needy: list[str]
) -> tuple[tuple[str, str], ...]:
    """A donor per catching-up member: ready hybrids first (they are not the core, so
    the core's steps are not slowed), then ready core replicas; fewest assignments
    first, ties by position."""
    order = [m for m in members if m.id in ready and m.kind == "hybrid"]
    order += [m for m in members if m.id in ready and m.kind == "core"]
    if needy and not order:
        raise RuntimeError("no ready replica to stream a snapshot from")
    load = {m.id: 0 for m in order}
    pairs = []
    for j in needy:
        donor = min(order, key=lambda m: load[m.id])
        load[donor.id] += 1
        pairs.append((j, donor.id))
    return tuple(pairs)


def next_epoch(
    cur: Epoch, *, leaving: set[str], joins: list[Member], ready: set[str], start: int
) -> Epoch:
    """The epoch after `cur`: leavers out, joiners appended (ticket order), a donor for
    each joiner. A member still catching up from an earlier epoch keeps its snapshot in
    flight (a leaving donor finishes streaming first), so it gets no new donor."""
    members = tuple(m for m in cur.members if m.id not in leaving) + tuple(joins)
    still = {m.id for m in members} & ready
    needy = [m.id for m in joins]
    return Epoch(
        number=cur.number + 1,
        name=f"e{cur.number + 1}",
        start=start,
        members=members,
        ready=frozenset(still),
        donors=assign_donors(members, still, needy),
        recoveries=cur.recoveries,
    )


@dataclass(slots=True)
class Summary:
    """Decoded control slots of one all-reduce (summed over replicas and ranks)."""

    tokens: int = 0
    samples: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    admit: int = 0
    leaving: set[int] = field(default_factory=set)
    ready: set[int] = field(default_factory=set)


class ControlLayout:
    """Offsets of the control slots for `max_replicas` replica slots."""

    def __init__(self, max_replicas: int):
        self.k = max_replicas
        self.metrics = 3
        self.admit = self.metrics + len(METRICS)
        self.leave = self.admit + 1
        self.ready = self.leave + self.k
        self.size = self.ready + self.k

    def encode(
        self, *, tokens: int, samples: int, metrics: dict[str, float], admit: int = 0,
        slot: int | None = None, leave: bool = False, ready: bool = False,
    ) -> list[float]:  # fmt: skip
        """Slot values from one rank; `slot` is None for ranks that carry no flags."""
        v = [0.0] * self.size
        v[0], v[1], v[2] = float(tokens // _LO), float(tokens % _LO), float(samples)
        for i, name in enumerate(METRICS):
            v[self.metrics + i] = float(metrics.get(name, 0.0))
        if slot is not None:
            if slot >= self.k:
                raise ValueError(f"replica slot {slot} >= elastic.max_replicas {self.k}")
            v[self.admit] = float(admit)
            v[self.leave + slot] = float(leave)
            v[self.ready + slot] = float(ready)
        return v

    def decode(self, v: list[float]) -> Summary:
        return Summary(
            tokens=round(v[0]) * _LO + round(v[1]),
            samples=round(v[2]),
            metrics={n: v[self.metrics + i] for i, n in enumerate(METRICS)},
            admit=round(v[self.admit]),
            leaving={k for k in range(self.k) if v[self.leave + k] > 0.5},
            ready={k for k in range(self.k) if v[self.ready + k] > 0.5},
        )


__all__ = ["ControlLayout", "Epoch", "Member", "Summary", "assign_donors", "next_epoch"]
