"""One inference instance (vLLM-like) on virtual time: continuous batching as a fluid.

Every active sequence gains one token per decode step; a step of B sequences holding K
context tokens takes `InstanceCost.step_time(B, K)` (the planner's cost model). Between
two events on the instance the batch is fixed, so one counter suffices: `decoded`, the
tokens every active sequence has gained since the instance started. A sequence that joins
at `decoded = d` with `n` tokens to generate finishes at `decoded = d + n`; the instance
keeps those marks in a heap, and the time to the next one follows from the step time,
which grows linearly with K as the batch's contexts grow (evaluated at the interval's
midpoint: exact while the step stays on one side of its memory/compute roofline).

As vLLM's scheduler does: waiting sequences are admitted first come, first served while
the batch has fewer than `max_num_seqs` and the KV cache holds the newcomer's context
(keeping a 1% watermark free);
when the running sequences' growth overflows the cache, the most recently admitted ones
are preempted (recompute mode: they keep what they generated, go back to the front of
the queue and prefill their whole context again when readmitted). Prefill is chunked
into the decode steps in vLLM; here an admission stalls the instance's decoding for the
prefill's compute time (`InstanceCost.prefill_s`), which is what the planner's work
bound charges too.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from typing import Any

from libra.planner import InstanceCost

_EPS = 1e-9
WATERMARK = 0.01
"""Share of the KV cache admission keeps free (vLLM's block-manager watermark), so a
sequence just preempted is not readmitted into a full cache."""


class Instance:
    __slots__ = (
        "_admits",
        "_heap",
        "_target",
        "active",
        "at",
        "bucket",
        "busy_s",
        "cost",
        "decoded",
        "done",
        "iid",
        "kv_base",
        "kv_cap",
        "max_seqs",
        "preemptions",
        "queue",
        "resume",
        "role",
        "t_ref",
        "tp",
        "version",
    )

    def __init__(
        self,
        iid: int,
        cost: InstanceCost,
        max_seqs: int,
        at: Callable[..., None],
        done: Callable[[Instance, Any, float], None],
    ):
        self.iid, self.tp, self.cost = iid, cost.tp, cost
        self.kv_cap, self.max_seqs = cost.kv_capacity, max_seqs
        self.at, self.done = at, done
        """`at(t, fn, *args)`: the event loop's scheduler."""
        self.role = "starting"
        """`starting` (engine launching), `live`, `lent` (a hybrid worker training),
        `gone`."""
        self.bucket = -1
        """Index of the routing bucket it serves (-1: none)."""
        self.active: dict[int, Any] = {}
        """Running sequences in admission order."""
        self._heap: list[tuple[float, int, Any]] = []
        self._admits = 0
        """Admissions so far: each one's key (in `active`, and the heap's tie-break among
        equal marks: admission order, never memory addresses, so a run does not depend
        on what ran before it in the process)."""
        self.queue: deque[Any] = deque()
        self.decoded = 0.0
        self.kv_base = 0.0
        """sum over active sequences of (context at join - `decoded` at join): the batch
        holds kv_base + B * decoded context tokens."""
        self.t_ref = 0.0
        self._target = 0.0
        self.resume = 0.0
        self.version = 0
        self.busy_s = 0.0
        self.preemptions = 0

    # --- state ------------------------------------------------------------------------
    @property
    def load(self) -> int:
        return len(self.active) + len(self.queue)

    @property
    def idle(self) -> bool:
        return not self.active and not self.queue

    def _top(self) -> float:
        """The next finish mark (dropping marks of preempted sequences)."""
        heap, active = self._heap, self.active
        mark, key, seq = heap[0]
        while key not in active or seq.d_end != mark:
            heapq.heappop(heap)
            mark, key, seq = heap[0]
        return mark

    def advance(self, now: float) -> None:
        """Bring `decoded` to time `now` (no sequence finishes before it)."""
        b = len(self.active)
        if b:
            t_ref, resume = self.t_ref, self.resume
            self.busy_s += now - t_ref
            dt = now - (resume if resume > t_ref else t_ref)
            if dt > 0.0:
                decoded, step_time = self.decoded, self.cost.step_time
                k = self.kv_base + b * decoded
                s0 = step_time(b, k)
                n = dt / s0
                # the step grows by `slope` per step: solve n s0 + slope n^2 / 2 = dt
                half = b * n / 2.0
                slope = (step_time(b, k + half) - s0) / half * b
                if slope > 1e-15:
                    n = 2.0 * dt / (s0 + (s0 * s0 + 2.0 * slope * dt) ** 0.5)
                self.decoded = min(decoded + n, self._top())
        self.t_ref = now

    # --- sequences ------------------------------------------------------------------
    def submit(self, seq: Any, now: float) -> None:
        """Queue a segment (`seq.seg` tokens to generate after prefilling
        `seq.pre_tokens` on top of `seq.pre_ctx` cached ones)."""
        q = self.queue
        q.append(seq)
        if len(q) == 1:
            self.advance(now)
            if self._admit(now):
                self._reschedule(now)

    def _admit(self, now: float) -> bool:
        """Start the queued segments that fit, first come first served (the instance has
        been advanced to `now`)."""
        q, admitted, stall = self.queue, False, 0.0
        active, heap, prefill_s = self.active, self._heap, self.cost.prefill_s
        decoded, kv_base, room = self.decoded, self.kv_base, self.kv_cap * (1.0 - WATERMARK)
        while q:
            seq = q[0]
            b = len(active)
            if b and (b >= self.max_seqs or kv_base + b * decoded + seq.ctx > room):
                break
            q.popleft()
            u, c = seq.pre_tokens, seq.pre_ctx
            stall += float(prefill_s(u, u * c + u * u / 2.0))
            key = self._admits = self._admits + 1
            active[key] = seq
            d_end = seq.d_end = decoded + seq.seg
            off = seq.kv_off = seq.ctx - decoded
            kv_base += off
            heapq.heappush(heap, (d_end, key, seq))
            admitted = True
        self.kv_base = kv_base
        if admitted:
            self.resume = (self.resume if self.resume > now else now) + stall
        return admitted

    def _preempt(self) -> bool:
        """Give KV back when the running sequences outgrew the cache: the newest go
        back to the front of the queue, keeping what they generated."""
        out = False
        while len(self.active) > 1 and (
            self.kv_base + len(self.active) * self.decoded > self.kv_cap - 0.5
        ):
            key = next(reversed(self.active))
            seq = self.active.pop(key)
            self.kv_base -= seq.kv_off
            seq.progress(int(self.decoded - (seq.d_end - seq.seg)))
            seq.d_end = -1.0
            self.queue.appendleft(seq)
            self.preemptions += 1
            out = True
        return out

    def _reschedule(self, now: float) -> None:
        """Schedule the next event: the next finish, or the step at which the batch's
        growth fills the KV cache (a preemption), whichever comes first."""
        self.version += 1
        b = len(self.active)
        if not b:
            self._heap.clear()
            return
        decoded, cap = self.decoded, self.kv_cap
        n = self._top() - decoded
        k = self.kv_base + b * decoded
        if b > 1 and k + b * n > cap:
            n = max(0.0, (cap - k) / b)
        self._target = decoded + n
        step = self.cost.step_time(b, k + b * max(n - 1.0, 0.0) / 2.0)
        resume = self.resume
        t = (resume if resume > now else now) + n * step
        self.at(t, self.complete, t, self.version)

    def complete(self, now: float, version: int) -> None:
        """The scheduled event (ignored when the batch changed since): sequences that
        reached their mark finish; a full cache preempts."""
        if version != self.version:
            return
        self.busy_s += now - self.t_ref
        self.t_ref = now
        decoded = self.decoded = self._target
        finished = []
        heap, active, reached = self._heap, self.active, decoded + _EPS
        while heap and heap[0][0] <= reached:
            mark, key, seq = heapq.heappop(heap)
            if seq.d_end == mark and key in active and active[key] is seq:
                del active[key]
                self.kv_base -= seq.kv_off
                finished.append(seq)
        if not active:  # drop the rounding the running sum gathered
            self.kv_base = 0.0
        self.version += 1
        done = self.done
        for seq in finished:
            done(self, seq, now)
        b = len(active)
        if b > 1 and self.kv_base + b * self.decoded > self.kv_cap - 0.5:
            self._preempt()
        if self.queue:
            self._admit(now)
        self._reschedule(now)

    def evict_queue(self) -> list[Any]:
        """Hand back the sequences still waiting."""
        out = list(self.queue)
        self.queue.clear()
        return out

    def evict_all(self, now: float) -> list[Any]:
        """Stop: hand back every sequence (running ones keep what they generated; their
        KV cache is lost)."""
        self.advance(now)
        out = []
        for seq in self.active.values():
            seq.progress(int(self.decoded - (seq.d_end - seq.seg)))
            out.append(seq)
        out += list(self.queue)
        self.active.clear()
        self._heap.clear()
        self.queue.clear()
        self.kv_base = 0.0
        self.version += 1
        return out


__all__ = ["Instance"]
