"""Bounded staleness enforced at admission: which step a group is trained in, decided
before its first episode starts.

Pure state machine (no asyncio, no clock): the loop asks it and acts.

Every training step `s` (the update that turns policy version `s` into `s + 1`) has
`batch_groups` slots. A group admitted while the endpoints serve version `v` takes the
earliest free slot of a step `s >= v`, and only if `s <= v + max_staleness`: its oldest
turn is then at most `max_staleness` versions behind the weights it is trained on. When
no such slot is free the group is *not started* (admission waits for the next version):
the long tail of a step is never thrown away for being stale, it is never allowed to
become stale in the first place.

Fast groups overtake slow ones: when step `s` is due and one of its groups is still
running while a group booked for a later step `s'` has finished, the two swap slots if the
running group may still be trained at `s'` (its deadline `admitted + max_staleness >= s'`).
Every group stays within its deadline, every step keeps exactly `batch_groups` slots.

Dynamic sampling (DAPO): a finished group whose rewards are all equal has no advantage
signal; `drop` frees its slot for a replacement group. After `max_replacements` drops
booked to one step, that step's further all-equal groups are kept (`keep_equal`), so a
policy that solves (or fails) everything still makes progress.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Booking:
    """One admitted group."""

    key: str
    admitted_version: int
    step: int
    """The step whose batch it is booked into (may move earlier by a swap, or later
    within its deadline)."""
    finished: bool = False

    def deadline(self, max_staleness: int) -> int:
        return self.admitted_version + max_staleness


@dataclass(slots=True)
class StalenessGate:
    batch_groups: int
    max_staleness: int
    max_replacements: int = 1_000_000
    version: int = 0
    """Policy version served now = steps trained so far (the next step to train)."""
    slots: dict[int, list[str]] = field(default_factory=dict)
    bookings: dict[str, Booking] = field(default_factory=dict)
    drops: dict[int, int] = field(default_factory=dict)
    """Dropped (all-equal) groups per step."""

    def __post_init__(self) -> None:
        if self.batch_groups < 1:
            raise ValueError("batch_groups must be >= 1")
        if self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")

    # -- admission --------------------------------------------------------------------

    def free_step(self) -> int | None:
        """The step a group admitted now would be booked into, or None (wait)."""
        for s in range(self.version, self.version + self.max_staleness + 1):
            if len(self.slots.get(s, ())) < self.batch_groups:
                return s
        return None

    def admit(self, key: str) -> int | None:
        """Book group `key` (about to start at `self.version`); its step, or None."""
        if key in self.bookings:
            raise ValueError(f"group {key!r} is already admitted")
        s = self.free_step()
        if s is None:
            return None
        self.slots.setdefault(s, []).append(key)
        self.bookings[key] = Booking(key, self.version, s)
        return s

    def in_flight(self) -> int:
        """Groups admitted and not finished."""
        return sum(not b.finished for b in self.bookings.values())

    # -- finishing --------------------------------------------------------------------

    def finish(self, key: str) -> None:
        """The group's episodes all ended and it is kept for training."""
        self.bookings[key].finished = True

    def keep_equal(self, key: str) -> bool:
        """Should a finished all-equal group be kept (the step's replacements ran out)?"""
        return self.drops.get(self.bookings[key].step, 0) >= self.max_replacements

    def drop(self, key: str) -> None:
        """Dynamic sampling (or an aborted group): free its slot for a replacement."""
        b = self.bookings.pop(key)
        self.slots[b.step].remove(key)
        self.drops[b.step] = self.drops.get(b.step, 0) + 1

    # -- the batch --------------------------------------------------------------------

    def ready(self) -> list[str] | None:
        """The keys of step `version`'s batch when all its slots hold finished groups
        (after swapping in finished groups of later steps), else None."""
        mine = self.slots.setdefault(self.version, [])
        if len(mine) < self.batch_groups:
            return None
        self._swap_in()
        if all(self.bookings[k].finished for k in mine):
            return list(mine)
        return None

    def _swap_in(self) -> None:
        mine = self.slots[self.version]
        later = sorted(s for s in self.slots if s > self.version)
        for i, k in enumerate(mine):
            slow = self.bookings[k]
            if slow.finished:
                continue
            for s in later:
                if slow.deadline(self.max_staleness) < s:
                    break
                fast = next((f for f in self.slots[s] if self.bookings[f].finished), None)
                if fast is None:
                    continue
                j = self.slots[s].index(fast)
                mine[i], self.slots[s][j] = fast, k
                self.bookings[fast].step, slow.step = self.version, s
                break

    def trained(self) -> list[str]:
        """Step `version` was trained on its batch: release it and advance the version."""
        keys = self.slots.pop(self.version, [])
        for k in keys:
            del self.bookings[k]
        self.drops.pop(self.version, None)
        self.version += 1
        return keys

    def staleness_of(self, key: str) -> int:
        """Versions between the group's admission and the step it is booked into."""
        b = self.bookings[key]
        return b.step - b.admitted_version


__all__ = ["Booking", "StalenessGate"]
