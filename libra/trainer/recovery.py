"""Dropping a crashed or hung hybrid: every surviving rank reports to the store, the
coordinator (core replica 0, rank 0) decides the new epoch, everyone builds its group.

A gloo collective with a dead peer fails at once (the peer's sockets close); with a
hung peer it fails only at the group's timeout — gloo cannot abort a collective — so
`elastic.timeout_s` bounds the core's stall, plus `report_window_s` for the reports.

Reports say how many updates each rank's state holds. Normally a failure stops every
member at the same update (the dead rank's contribution is needed by everyone's sum),
and the survivors retry that update without it. If the peer died after its very last
message, some ranks may have completed the update and others not: the decision takes
the furthest state as current, and the ranks behind it catch up from a snapshot like a
joiner, so the replicas never diverge.

Store keys, for recovery number g: `recover/{g}/open`, `recover/{g}/report/{id}/{rank}`,
`recover/{g}/decision` (an epoch named `e{n}-r{g}`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from libra.errors import ReplicaDropped, TrainerError
from libra.trainer.membership import Epoch, Member, assign_donors
from libra.trainer.rendezvous import wait_key

if TYPE_CHECKING:
    from libra.trainer.elastic import ElasticWorker

log = logging.getLogger("libra.trainer")


@dataclass(slots=True)
class Outcome:
    retry: bool
    """This rank is current: redo the failed update in the new epoch."""
    dropped: list[str] = field(default_factory=list)


def _base(w: ElasticWorker) -> str:
    ep = w.state.epoch or w.state.next_spec
    assert ep is not None
    return f"recover/{ep.recoveries}"


def pending(w: ElasticWorker) -> bool:
    """Has another rank opened a recovery this rank has not joined yet?"""
    return w.state.epoch is not None and bool(w.store.check([f"{_base(w)}/open"]))


def recover(w: ElasticWorker, update: int) -> Outcome:
    """Take part in recovery after the all-reduce of `update` failed (or another rank
    opened one while this rank was idle). Raises ReplicaDropped if this rank is left out."""
    st = w.state
    base = _base(w)
    w.store.set(f"{base}/open", "1")
    w.donor.wait_copied()
    w.donor.cancel()
    report = {
        "kind": w.kind, "ticket": st.ticket, "addr": w.addr, "ready": st.ready,
        "updates": w.replica.updates if st.ready else -1,
    }  # fmt: skip
    w.store.set(f"{base}/report/{w.id}/{w.rank}", json.dumps(report))
    old = {m.id for m in _expected(w)}
    if st.coordinator:
        w.store.set(f"{base}/decision", _decide(w, base).to_json())
    wait = 2 * w.ecfg.timeout_s + w.ecfg.report_window_s + 30
    try:
        spec = Epoch.from_json(wait_key(w.store, f"{base}/decision", wait))
    except TimeoutError:
        raise TrainerError(f"{w.id}: no recovery decision (is the coordinator alive?)") from None
    w.abandon_pending()  # its build times out on its own; close() waits for it
    if w.id not in spec.ids():
        w.mark_dropped()
        raise ReplicaDropped(f"{w.id} was dropped from training by recovery {base}")
    w.enter_recovered_epoch(spec)
    dropped = sorted(old - set(spec.ids()))
    if w.id in spec.ready:
        if w.replica.updates != spec.start - 1:
            raise TrainerError(f"{w.id}: state at {w.replica.updates}, epoch starts {spec.start}")
        w.mark_current()
        return Outcome(retry=update == spec.start, dropped=dropped)
    if w.kind == "core" and not st.ready:
        log.warning("%s/%d: behind after recovery, catching up from a snapshot", w.id, w.rank)
    w.expect_snapshot(spec)
    return Outcome(retry=False, dropped=dropped)


def _expected(w: ElasticWorker) -> list[Member]:
    """Members this rank knows of: the current epoch, then any announced next one."""
    seen: dict[str, Member] = {}
    for ep in (w.state.epoch, w.state.next_spec):
        for m in ep.members if ep else ():
            seen.setdefault(m.id, m)
    return list(seen.values())


def _decide(w: ElasticWorker, base: str) -> Epoch:
    cfg = w.ecfg
    members = _expected(w)
    keys = {m.id: [f"{base}/report/{m.id}/{r}" for r in range(w.size)] for m in members}

    def complete(mid: str) -> bool:
        return bool(w.store.check(keys[mid]))

    core = [m.id for m in members if m.kind == "core"]
    deadline = time.monotonic() + cfg.timeout_s + cfg.report_window_s
    while not all(complete(c) for c in core):
        if time.monotonic() > deadline:
            missing = [c for c in core if not complete(c)]
            raise TrainerError(f"core replica(s) {missing} did not report after a failure")
        time.sleep(0.01)
    deadline = time.monotonic() + cfg.report_window_s
    while not all(complete(m.id) for m in members) and time.monotonic() < deadline:
        time.sleep(0.01)
    survivors, ready, state = [], [], {}
    for m in members:
        if not complete(m.id):
            continue
        reps = [json.loads(bytes(w.store.get(k)).decode()) for k in keys[m.id]]
        survivors.append(Member(m.id, m.kind, m.ticket, tuple(r["addr"] for r in reps)))
        ups = {r["updates"] for r in reps}
        if all(r["ready"] for r in reps) and len(ups) == 1:
            state[m.id] = ups.pop()
    if not state:
        raise TrainerError("no replica holds a current state after the failure")
    latest = max(state.values())
    ready = [mid for mid, n in state.items() if n == latest]
    needy = [m.id for m in survivors if m.id not in ready]
    cur = [ep for ep in (w.state.epoch, w.state.next_spec) if ep is not None]
    number = max(ep.number for ep in cur) + 1
    g = cur[0].recoveries
    log.warning(
        "recovery %d: survivors %s, current at update %d, catching up %s",
        g, [m.id for m in survivors], latest, needy,
    )  # fmt: skip
    members_t = tuple(survivors)
    return Epoch(
        number=number, name=f"e{number}-r{g}", start=latest + 1, members=members_t,
        ready=frozenset(ready), donors=assign_donors(members_t, set(ready), needy),
        recoveries=g + 1,
    )  # fmt: skip


__all__ = ["Outcome", "pending", "recover"]
