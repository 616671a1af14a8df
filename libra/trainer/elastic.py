"""Elastic data parallelism on plain torch.distributed: one rank's side of the protocol.

Every optimizer update ("step" below) on every member rank:

1. switch epoch if one starts now (its group was built in the background);
   a donor starts copying its state to staging (in a thread);
2. forward/backward on this rank's samples (nothing for a rank that is catching up);
3. one all-reduce over the shard's cross-replica group of [summed gradient | control
   slots]: gradients, token counts, metrics, and the admit / leave / ready flags;
4. for replicas of several ranks, one small all-reduce inside the replica agrees on
   tokens, the gradient norm, failures and readiness;
5. apply: divide by the global token count, clip, AdamW (`Replica.apply`); a catching-up
   rank queues the averaged gradient for replay instead;
6. if the control slots announced joins or leaves, start building the next epoch's
   group in the background; it is used from the next step on.

A joiner contributes zero gradient and zero tokens, so the sums — and the average —
equal those without it. See docs/elastic.md for the whole design and its limits.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Literal

import torch
import torch.distributed as dist

from libra.errors import ReplicaDropped, TrainerError
from libra.trainer import grpo
from libra.trainer.catchup import CatchUp
from libra.trainer.config import TrainerConfig
from libra.trainer.device import cross_replica_group
from libra.trainer.membership import ControlLayout, Epoch, Member, Summary, next_epoch
from libra.trainer.rendezvous import PREFIX, Background, GroupReaper, connect, get_str, wait_key
from libra.trainer.replica import Replica, sumsq
from libra.trainer.report import StepResult
from libra.trainer.samples import Sample
from libra.trainer.snapshot import Donor, Job, addr_of, listen
from libra.trainer.standing import MemberState, Pending

log = logging.getLogger("libra.trainer")


def token(epoch: Epoch, member_id: str, rank: int) -> str:
    """Names one snapshot: the epoch that asks for it and its recipient rank."""
    return f"{epoch.name}/{member_id}/{rank}"


class ElasticWorker:
    """One process of one replica in the elastic domain."""

    def __init__(
        self, cfg: TrainerConfig, replica: Replica, *, member_id: str,
        kind: Literal["core", "hybrid"], store_port: int, prefix: str = PREFIX,
        store_host: str | None = None, host: str | None = None,
    ):  # fmt: skip
        self.cfg, self.ecfg = cfg, cfg.elastic
        self.replica = replica
        self.id, self.kind = member_id, kind
        self.rank, self.size = replica.rank, replica.size
        self.store_host = store_host or self.ecfg.host
        """Where the run's rendezvous store is (the driver's address)."""
        self.host = host or self.ecfg.host
        """The address this rank's own sockets bind to (its node's, on a cluster)."""
        self.port, self.prefix = store_port, prefix
        self.store = connect(self.store_host, store_port, prefix)
        self.layout = ControlLayout(self.ecfg.max_replicas)
        n = replica.grad_numel
        # The domain's host buffers (gloo); pinned beside a GPU for faster copies.
        pin = replica.device.type == "cuda"
        self.bufs = [torch.zeros(n + self.layout.size, pin_memory=pin) for _ in range(2)]
        self.listener = listen(self.host)
        self.addr = addr_of(self.listener)
        self.donor = Donor(replica, rate_mb_s=self.ecfg.snapshot_rate_mb_s,
                           timeout_s=self.ecfg.timeout_s)  # fmt: skip
        self.catchup = CatchUp(replica, self.listener, timeout_s=self.ecfg.timeout_s,
                               max_mb=self.ecfg.max_catchup_mb)  # fmt: skip
        self.groups = GroupReaper()
        self.state = MemberState(update=replica.updates, ready=kind == "core")
        """Where this rank stands (epochs, flags, ticket): changed only by the methods
        of this class, recovery's included."""

    # -- membership entry points ------------------------------------------------------

    def start_core(self, core_ids: list[str]) -> None:
        """Core replicas: form epoch 0 (blocking; all core ranks call it)."""
        st = self.state
        st.coordinator = self.id == core_ids[0] and self.rank == 0
        st.ready_ids = set(core_ids)
        ep = Epoch(
            number=0, name="e0", start=st.update + 1,
            members=tuple(Member(c, "core") for c in core_ids), ready=frozenset(core_ids),
        )  # fmt: skip
        st.pg = self._build(ep)
        st.epoch = ep

    def register(self) -> int:
        """Hybrids: ask to join; returns the ticket. Admission comes at a later update."""
        addrs = [self.addr]
        if self.size > 1:
            gathered: list[Any] = [None] * self.size
            dist.all_gather_object(gathered, self.addr)
            addrs = [str(a) for a in gathered]
        t = [0]
        if self.rank == 0:
            t[0] = int(self.store.add("tickets", 1))
            record = {"id": self.id, "addrs": addrs, "ranks": self.size}
            self.store.set(f"ticket/{t[0]}", json.dumps(record))
        if self.size > 1:
            dist.broadcast_object_list(t, src=0)
        self.state.ticket, self.state.registered_at = t[0], time.perf_counter()
        return self.state.ticket

    def poll_admission(self) -> bool:
        """Non-blocking: has the coordinator admitted our ticket? Enters its epoch if so."""
        if self.state.epoch is not None or self.state.pending is not None:
            return True
        key = f"ticket/{self.state.ticket}/admit"
        if not self.store.check([key]):
            return False
        self._admitted(get_str(self.store, key))
        return True

    def wait_admission(self, timeout_s: float) -> None:
        if not self.poll_admission():
            self._admitted(wait_key(self.store, f"ticket/{self.state.ticket}/admit", timeout_s))

    def cancel(self) -> bool:
        """Withdraw a registration; False if the coordinator admitted it first (then
        leave through `leave()` at the first step instead)."""
        got = self.store.compare_set(f"ticket/{self.state.ticket}/state", "", "cancelled")
        return bytes(got) == b"cancelled"

    def member_at(self, update: int) -> bool:
        """Does this rank take part in `update`?"""
        st = self.state
        if st.epoch is not None and not st.left:
            return True
        return st.pending is not None and st.pending.start <= update

    def leave(self) -> None:
        """Leave after the next update (the flag rides on its all-reduce)."""
        if self.kind == "core":
            raise TrainerError("core replicas are fixed; only hybrid replicas leave")
        self.state.leaving = True

    # -- one update -------------------------------------------------------------------

    def step(
        self, samples: list[Sample] | tuple[()] = (), old: list[torch.Tensor] | None = None
    ) -> StepResult:
        from libra.trainer.recovery import recover

        st = self.state
        clock = time.perf_counter
        t0 = clock()
        tm: dict[str, float] = {}
        u = st.update + 1
        self._donate_early(u)  # the staging copy runs while this update computes
        self.donor.tick()
        if not st.ready and self.catchup.error:
            if self.kind == "core":
                raise TrainerError(f"{self.id}/{self.rank}: {self.catchup.error}")
            if not st.leaving:  # give up gracefully; the driver may add it again
                log.warning("%s/%d: %s; leaving", self.id, self.rank, self.catchup.error)
                st.leaving = True
                st.leave_reason = self.catchup.error
        dropped: list[str] = []
        contributed = st.ready and bool(samples)
        t = clock()
        stats = self._compute(list(samples), old) if st.ready else grpo.LocalStats()
        tm["compute_s"] = clock() - t
        # The next epoch's group was built in the background during the compute.
        tm["wait_group_s"] = self._maybe_switch(u, dropped)
        while True:
            t = clock()
            flat = self.bufs[u % 2]
            n = self.replica.grad_numel
            if st.ready:
                self.replica.pack_grads(flat)
            else:
                flat[:n].zero_()
            flat[n:] = torch.tensor(self._control(stats))
            tm["pack_s"] = clock() - t
            t = clock()
            failed = self._allreduce(flat)
            tm["allreduce_s"] = tm.get("allreduce_s", 0.0) + clock() - t
            total = self._intra(flat, failed)
            if total[-2] == 0:
                break
            t = clock()
            outcome = recover(self, u)
            tm["recover_s"] = tm.get("recover_s", 0.0) + clock() - t
            dropped += outcome.dropped
            if not outcome.retry:
                return self._result(u, None, 0.0, False, False, tm, t0, dropped)
        s = self.layout.decode(total[: self.layout.size].tolist())
        gsq, votes = float(total[-3]), int(total[-1])
        became_ready = False
        norm = 0.0
        t = clock()
        if st.ready:
            tm["wait_copy_s"] = self.donor.wait_copied()
            norm = self.replica.apply(flat[:n], s.tokens, gsq)
        elif votes == self.size:
            norm = self.replica.apply(flat[:n], s.tokens, gsq)
            st.ready = became_ready = True
            self.catchup.finish()
            st.ready_after_s = clock() - st.registered_at
        else:
            self.catchup.push(u, flat[:n].clone(), s.tokens, gsq)
        tm["apply_s"] = clock() - t
        st.update = u
        res = self._result(u, s, norm, st.ready, contributed, tm, t0, dropped)
        res.became_ready = became_ready
        res.join_latency_s = st.ready_after_s if became_ready else None
        self._after(s, u, res)
        res.timings["total_s"] = clock() - t0
        return res

    def _compute(self, samples: list[Sample], old: list[torch.Tensor] | None) -> grpo.LocalStats:
        count = None
        if self.size > 1:  # FSDP ranks of a replica must run the same number of passes
            count = self.replica.intra_max(grpo.passes(samples, self.cfg.grpo))
        return grpo.backward(
            self.replica.model, samples, self.cfg.grpo, dtype=self.cfg.dtype,
            device=self.replica.device, old=old, ref_model=self.replica.ref_model, count=count,
        )  # fmt: skip

    def _control(self, stats: grpo.LocalStats) -> list[float]:
        st = self.state
        assert st.epoch is not None
        flags = self.rank == 0
        admit = self._admit() if st.coordinator else 0
        return self.layout.encode(
            tokens=stats.tokens, samples=stats.samples, metrics=stats.metrics, admit=admit,
            slot=st.epoch.slot(self.id) if flags else None, leave=st.leaving,
            ready=st.ready,
        )  # fmt: skip

    def _allreduce(self, flat: torch.Tensor) -> bool:
        try:
            self.state.pg.allreduce([flat]).wait()
            return False
        except RuntimeError as e:
            log.warning("%s/%d: all-reduce failed: %s", self.id, self.rank, str(e)[:200])
            return True

    def _intra(self, flat: torch.Tensor, failed: bool) -> torch.Tensor:
        """[control sums..., sumsq, failed, ready votes] summed over the replica."""
        n = self.replica.grad_numel
        ctl = (
            flat[n:].double() if not failed else torch.zeros(self.layout.size, dtype=torch.float64)
        )
        vote = 1.0 if (not self.state.ready and self.catchup.drained()) else 0.0
        tail = torch.tensor([0.0 if failed else sumsq(flat[:n]), float(failed), vote],
                            dtype=torch.float64)  # fmt: skip
        v = torch.cat([ctl, tail])
        try:
            return self.replica.intra_sum(v)
        except RuntimeError as e:
            raise (TrainerError if self.kind == "core" else ReplicaDropped)(
                f"{self.id}: a rank of this replica failed: {e}"
            ) from None

    def _result(
        self, u: int, s: Summary | None, norm: float, applied: bool, contributed: bool,
        tm: dict[str, float], t0: float, dropped: list[str],
    ) -> StepResult:  # fmt: skip
        ep = self.state.epoch
        assert ep is not None
        tm["total_s"] = time.perf_counter() - t0
        return StepResult(
            update=u, applied=applied, contributed=contributed,
            tokens=s.tokens if s else 0, samples=s.samples if s else 0,
            metrics=s.metrics if s else {}, grad_norm=norm,
            lr=self.replica.lr_at(u), epoch=ep.name, members=ep.ids(),
            dropped=dropped, timings=tm,
        )  # fmt: skip

    # -- epochs -----------------------------------------------------------------------

    def _admit(self) -> int:
        """Coordinator: admit registered tickets (compare-and-set against a cancel)."""
        st = self.state
        assert st.epoch is not None
        st.joins = []
        room = self.ecfg.max_replicas - len(st.epoch.members)
        total = int(self.store.add("tickets", 0))
        while st.scanned < total and len(st.joins) < room:
            t = st.scanned + 1
            if not self.store.check([f"ticket/{t}"]):
                break  # registered but its record is not written yet
            st.scanned = t
            state = bytes(self.store.compare_set(f"ticket/{t}/state", "", "admitted"))
            if state == b"admitted":
                rec = json.loads(get_str(self.store, f"ticket/{t}"))
                st.joins.append(Member(rec["id"], "hybrid", t, tuple(rec["addrs"])))
        return len(st.joins)

    def _after(self, s: Summary, u: int, res: StepResult) -> None:
        st = self.state
        assert st.epoch is not None
        ep = st.epoch
        leaving = {ep.members[k].id for k in s.leaving if k < len(ep.members)}
        res.leaving = sorted(leaving)
        st.ready_ids = {ep.members[k].id for k in s.ready if k < len(ep.members)} - leaving
        if not leaving and s.admit == 0:
            return
        name = f"e{ep.number + 1}"
        st.next_spec = None
        if st.coordinator:
            ready = {ep.members[k].id for k in s.ready if k < len(ep.members)}
            spec = next_epoch(ep, leaving=leaving, joins=st.joins, ready=ready, start=u + 1)
            self.store.set(f"epoch/{name}", spec.to_json())
            st.next_spec = spec
            for m in st.joins:
                self.store.set(f"ticket/{m.ticket}/admit", name)
            res.joining = [m.id for m in st.joins]
            st.joins = []
        if self.id in leaving:
            st.left = res.left = True
            res.reason = st.leave_reason
            return
        st.pending = Pending(name, u + 1, self._builder(name), st.next_spec)

    def _builder(self, name: str) -> Background:
        return Background(lambda: self._build_named(name), f"build-{name}")

    def _admitted(self, name: str) -> None:
        st = self.state
        spec = Epoch.from_json(wait_key(self.store, f"epoch/{name}", self.ecfg.timeout_s))
        st.next_spec = spec
        st.pending = Pending(name, spec.start, self._builder(name), spec)
        st.update = spec.start - 1
        self.catchup.expect(token(spec, self.id, self.rank))

    def _build_named(self, name: str) -> tuple[Epoch, Any]:
        store = connect(self.store_host, self.port, self.prefix)
        spec = Epoch.from_json(wait_key(store, f"epoch/{name}", self.ecfg.timeout_s))
        if self.id not in spec.ids():
            raise ReplicaDropped(f"{self.id} is not a member of epoch {name}")
        return spec, self._build(spec, store)

    def _build(self, ep: Epoch, store: Any = None) -> Any:
        return cross_replica_group(
            self.replica.device, store or connect(self.store_host, self.port, self.prefix),
            f"{ep.name}/s{self.rank}", ep.slot(self.id), len(ep.members),
            timeout_s=self.ecfg.timeout_s, host=self.host,
        )  # fmt: skip

    def _donate_early(self, u: int) -> None:
        """If an epoch starts with this update and names this rank a donor, queue its
        jobs now so the staging copy overlaps the forward/backward."""
        p = self.state.pending
        if p is None or p.start != u or p.donated:
            return
        if p.spec is None:  # written by the coordinator right after the previous update
            p.spec = Epoch.from_json(wait_key(self.store, f"epoch/{p.name}", self.ecfg.timeout_s))
        self._donate(p.spec)
        p.donated = True

    def _donate(self, spec: Epoch) -> None:
        jobs = [
            Job(token(spec, j, self.rank), spec.member(j).addrs[self.rank])
            for j in spec.recipients(self.id)
        ]
        if jobs:
            self.donor.add(jobs)

    def _maybe_switch(self, u: int, dropped: list[str]) -> float:
        """Switch to the epoch that starts at update `u`, if one does (its group was
        built in the background). A build that fails means a member never came: one
        admitted after its last message, whose process then died (its node lost). Its
        group cannot form, so this rank opens a recovery, as after a failed all-reduce,
        and the epoch it decides (without that member) is current from `u` on; the
        members it left out are added to `dropped`."""
        from libra.trainer.recovery import recover

        st = self.state
        if st.pending is None:
            return 0.0
        t = time.perf_counter()
        if st.pending.start > u:
            return 0.0
        if st.pending.start < u:
            raise TrainerError(f"{self.id}: epoch {st.pending.name} was due at update "
                               f"{st.pending.start}, now {u}")  # fmt: skip
        donated = st.pending.donated
        try:
            spec, pg = st.pending.job.result(self.ecfg.timeout_s + 30)
        except (RuntimeError, TimeoutError) as e:  # c10d's store / gloo errors, our timeout
            log.warning("%s/%d: epoch %s did not form (%s); recovering", self.id, self.rank,
                        st.pending.name, str(e)[:200])  # fmt: skip
            outcome = recover(self, u)
            dropped += outcome.dropped
            return time.perf_counter() - t
        self._switch(spec, pg, donate=not donated)
        return time.perf_counter() - t

    def _switch(self, spec: Epoch, pg: Any, *, donate: bool = True) -> None:
        """Make `spec` current (and hand its donor jobs to the snapshot streamer)."""
        st = self.state
        self.groups.retire(st.pg)
        st.epoch, st.pg, st.pending, st.next_spec = spec, pg, None, None
        if donate:
            self._donate(spec)

    def rejoin_reset(self) -> None:
        """After leaving: forget the old membership so this process can register again
        (its state is stale; a new snapshot will overwrite it)."""
        st = self.state
        self.groups.retire(st.pg)
        self.abandon_pending()
        st.pg, st.epoch, st.next_spec = None, None, None
        st.ready = st.leaving = st.left = False
        st.ready_after_s = None
        st.leave_reason = None

    def abandon_pending(self) -> None:
        """Forget the next epoch (a recovery replaced it); its build, which gloo cannot
        interrupt, is left to finish or time out and is waited for by `close`."""
        if self.state.pending is not None:
            self.groups.abandon(self.state.pending.job)
            self.state.pending = None
        self.groups.reap(0.0)

    # -- what a failure recovery does to this rank (`libra.trainer.recovery`) ---------

    def mark_dropped(self) -> None:
        """The recovery's epoch leaves this rank out: it is no longer a member."""
        self.state.left = True

    def enter_recovered_epoch(self, spec: Epoch) -> None:
        """Make the recovery's epoch current: build its group now (every survivor
        builds it at this point, so this blocks until they all have), switch to it, and
        count updates from its start."""
        self._switch(spec, self._build(spec))
        self.state.update = spec.start - 1

    def mark_current(self) -> None:
        """This rank's state is current at the recovered epoch's start: it trains from
        the next update, and starts any snapshot the epoch has it donate."""
        self.state.ready = True
        self.donor.tick()

    def expect_snapshot(self, spec: Epoch) -> None:
        """This rank is behind the recovered epoch: catch up from the snapshot its
        donor streams, like a joiner."""
        self.state.ready = False
        self.catchup.expect(token(spec, self.id, self.rank))

    def close(self) -> None:
        """Stop every background thread of this rank before returning: snapshot streams,
        catch-up, group builds (each bounded by the group's timeout), then retire the
        groups and wait for that. A thread still inside torch's C++ code when the
        interpreter shuts down aborts the process (see `libra.trainer.rendezvous`)."""
        self.donor.close()
        self.catchup.stop()
        self.listener.close()
        self.abandon_pending()
        self.groups.reap(self.ecfg.timeout_s + 30)  # a build: store wait + rendezvous
        self.groups.retire(self.state.pg)
        self.state.pg = None
        self.groups.join(self.ecfg.timeout_s)


__all__ = ["ElasticWorker", "token"]
