"""Where one rank stands in the elastic domain: its epochs, its flags, its ticket.

`ElasticWorker` keeps this as one object, `worker.state`. Its own methods are the only
code that changes it (recovery goes through them too: `enter_recovered_epoch`,
`mark_current`, `expect_snapshot`, `mark_dropped`); everyone else reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from libra.trainer.membership import Epoch, Member
from libra.trainer.rendezvous import Background


@dataclass(slots=True)
class Pending:
    """The next epoch: its name, first update, and the background build of its group."""

    name: str
    start: int
    job: Background
    spec: Epoch | None = None
    donated: bool = False


@dataclass(slots=True)
class MemberState:
    """One rank's membership state."""

    update: int
    """Optimizer updates this rank has taken part in (its next one is `update + 1`)."""
    ready: bool
    """This rank's state is current: it trains, and may donate snapshots (a joiner is
    not ready until its snapshot is in and replayed)."""
    epoch: Epoch | None = None
    """The current epoch (None before the first admission, and after leaving)."""
    pg: Any = None
    """The current epoch's cross-replica group of this rank's shard."""
    pending: Pending | None = None
    """The next epoch, its group being built in the background."""
    next_spec: Epoch | None = None
    """The next epoch when this rank knows it (coordinator, joiners): recovery uses it."""
    coordinator: bool = False
    """Core replica 0's rank 0: admits joiners and decides epochs and recoveries."""
    ticket: int = 0
    """A hybrid's registration ticket in the store (0: none)."""
    leaving: bool = False
    """Set: the leave flag rides on the next update's all-reduce."""
    leave_reason: str | None = None
    """Why this rank is leaving by itself (its snapshot was too slow), if it is."""
    left: bool = False
    """This rank is out of training (it left, or a recovery dropped it)."""
    registered_at: float = 0.0
    """perf_counter at registration (hybrids)."""
    ready_after_s: float | None = None
    """Seconds from registration to the first real gradient (hybrids)."""
    ready_ids: set[str] = field(default_factory=set)
    """Members that were current at the last update and stay (its ready flags minus
    its leavers): every member knows the same set, e.g. to split a global batch."""
    scanned: int = 0
    """Coordinator: tickets looked at so far (admission goes on from the next)."""
    joins: list[Member] = field(default_factory=list)
    """Coordinator: joiners admitted with the current update."""


__all__ = ["MemberState", "Pending"]
