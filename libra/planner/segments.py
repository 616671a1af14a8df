"""Rollout time of a contiguous range of length bins served by m instances of one type.

The busiest of the m instances gets q = ceil(n/m) of the segment's n episodes (requests
are dealt round-robin in length order, so every instance sees the same mix) and serves
them with continuous batching: B = min(q, max_num_seqs, KV capacity / mean resident
context) sequences per step. Its time is the larger of

- the work bound: steps x (weights read + step overhead) + all KV reads + compute, over
  its share of the segment's tokens (q/n of them), with steps = share of decode tokens / B;
- the critical path: the longest episode's own decode steps, plus its tool time and its
  prefill. Its steps are timed at the batch it decodes in *on average*: the instance
  that holds it decodes its G tokens and, for its q - 1 other episodes, (q - 1) x (mean
  generated tokens), so over its G steps the batch averages 1 + (q - 1) x mean / G
  sequences (and at most B): the batch drains as the shorter episodes finish and the
  tail decodes nearly alone. Charging the tail a full batch's step time instead
  overestimates a wide, heavy-tailed segment up to 2x (docs/simulation.md); counting
  the instance's tokens as q x mean (the tail's own as a mean one) made the tail decode
  alone however many episodes shared its instance, so the model ignored what more
  instances buy the tail (docs/simulation.md, "The tail's batch"). The drain average is
  exact when every episode is resident from the start and a lower bound otherwise, and
  the work bound covers the rest. A fractional batch reads the experts of an MoE model
  by interpolating between the whole batches around it.

Both bounds grow with q, so for a target time tau the largest feasible q has a closed
form (dense models) or a short integer bisection (MoE, whose expert reads grow with B);
the fewest instances meeting tau is then ceil(n / q). Forward evaluation (`time`) and the
inversion (`min_instances`) agree exactly: the inversion's closed form is checked
against the forward function wherever rounding could tip it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from libra.planner.rollout_cost import InstanceCost
from libra.planner.workload import Bins

_INF = np.inf


class SegmentModel:
    """Segment times for every (type, first bin j, end bin i) with j < i."""

    def __init__(self, bins: Bins, types: Sequence[InstanceCost], max_num_seqs: int):
        self.bins = bins
        self.types = list(types)
        self.tp = np.array([ic.tp for ic in self.types], dtype=np.int64)
        nb = bins.nbins
        self.nb = nb
        s = bins.stats
        j, i = np.meshgrid(np.arange(nb + 1), np.arange(nb + 1), indexing="ij")
        self.valid = j < i
        self._j, self._i = j, i

        def seg(values: np.ndarray) -> np.ndarray:
            cum = np.concatenate([[0.0], np.cumsum(bins.sums(values))])
            return cum[i] - cum[j]

        self.n = np.where(self.valid, seg(np.ones(s.n)), 0.0).round()
        self.gen = seg(s.generated)
        self.kv = seg(s.kv_reads)
        self.gen_max = bins.maxes(s.generated)
        self.ctx_max = _range_max(bins.maxes(s.total), nb)
        self.ctx_res = np.where(self.gen > 0, self.kv / np.maximum(self.gen, 1e-30), 0.0)
        k = len(self.types)
        shape = (k, nb + 1, nb + 1)
        self.pf = np.zeros(shape)
        self.other_max = np.zeros((k, nb))
        self.bcap = np.zeros(shape)
        for t, ic in enumerate(self.types):
            per_ep = np.asarray(ic.prefill_s(s.prefill_tokens, s.prefill_pairs))
            self.pf[t] = seg(per_ep)
            self.other_max[t] = bins.maxes(s.tool_s + per_ep)
            by_kv = np.floor(ic.kv_capacity / np.maximum(self.ctx_res, 1e-30))
            bcap = np.minimum(float(max_num_seqs), by_kv)
            ok = self.valid & (self.ctx_max <= ic.kv_capacity) & (bcap >= 1.0) & ic.fits
            self.bcap[t] = np.where(ok, bcap, 0.0)
        # Segment membership of bins, for the critical path: member[b, j, i].
        b = np.arange(nb)[:, None, None]
        self._member = (j[None] <= b) & (b < i[None])
        self._upper = np.arange(nb)[None, :] >= np.arange(nb + 1)[:, None]  # bin b >= j
        self._inf_col = np.full((nb + 1, 1), _INF)
        self._diag = np.eye(nb + 1, dtype=bool)
        # (bin, segment) membership pairs, grouped by segment (j, i), for the critical
        # path's inversion: a reduction per segment over its own bins only.
        seg_j, seg_i = np.nonzero(self.valid)
        width = seg_i - seg_j
        self._pj = np.repeat(seg_j, width)
        self._pi = np.repeat(seg_i, width)
        starts = np.concatenate([[0], np.cumsum(width)[:-1]])
        self._pb = np.arange(int(width.sum())) - np.repeat(starts, width) + self._pj
        self._seg_j, self._seg_i, self._starts = seg_j, seg_i, starts
        self._pre_cache: dict[int, dict[str, Any]] = {}
        batches = np.arange(max_num_seqs + 1, dtype=float)
        self._wread_table = [
            np.asarray(ic.weight_read_s(np.maximum(batches, 1.0))) for ic in self.types
        ]

    # --- forward -------------------------------------------------------------------------
    def _wread(self, t: int, batch: np.ndarray | float) -> np.ndarray:
        """Weights read per step (a table of whole batches: MoE reads are a power; a
        fractional batch, the critical path's average, interpolates between two)."""
        table = self._wread_table[t]
        b = np.minimum(np.asarray(batch, dtype=float), len(table) - 1)
        lo = np.floor(b).astype(np.int64)
        hi = np.minimum(lo + 1, len(table) - 1)
        return table[lo] + (b - lo) * (table[hi] - table[lo])

    def _step(self, t: int, batch: np.ndarray, ctx_res: np.ndarray) -> np.ndarray:
        """`InstanceCost.step_s` with the weights read from the table."""
        ic = self.types[t]
        kv = batch * ctx_res
        mem = self._wread(t, batch) + kv * ic.kv_time_per_token
        cmp = batch * ic.cmp_per_token_s + kv * ic.cmp_per_pair_s
        return np.maximum(mem, cmp) + ic.comm_step_s + batch * ic.comm_per_token_s

    def _work(self, t: int, q: np.ndarray, idx: tuple[np.ndarray, ...]) -> np.ndarray:
        ic = self.types[t]
        n, gen, kv = self.n[idx], self.gen[idx], self.kv[idx]
        bcap = self.bcap[t][idx]
        batch = np.maximum(np.minimum(q, bcap), 1.0)
        f = q / np.maximum(n, 1.0)
        steps = f * gen / batch
        mem = steps * self._wread(t, batch) + f * kv * ic.kv_time_per_token
        cmp = f * gen * ic.cmp_per_token_s + f * kv * ic.cmp_per_pair_s
        return (
            np.maximum(mem, cmp)
            + steps * ic.comm_step_s
            + f * gen * ic.comm_per_token_s
            + f * self.pf[t][idx]
        )

    def _crit(self, t: int, q: np.ndarray, idx: tuple[np.ndarray, ...]) -> np.ndarray:
        """Per member bin b: its longest episode's gen_max[b] steps at the drain-average
        batch clip(1 + (q - 1) x mean generated / gen_max[b], 1, B), plus its tool and
        prefill time; the segment's critical path is the longest of these lines."""
        bcap = np.maximum(np.minimum(q, self.bcap[t][idx]), 1.0)
        shape = (-1,) + (1,) * bcap.ndim
        gm = self.gen_max.reshape(shape)
        per_ep = self.gen[idx] / np.maximum(self.n[idx], 1.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            avg = np.where(gm > 0, 1.0 + np.maximum(q - 1.0, 0.0) * per_ep / gm, 1.0)
        batch = np.clip(avg, 1.0, bcap[None])
        step = self._step(t, batch, np.broadcast_to(self.ctx_res[idx], bcap.shape)[None])
        lines = gm * step + self.other_max[t].reshape(shape)
        member = self._member[:, idx[0], idx[1]]
        return np.where(member, lines, -_INF).max(axis=0)

    def time_q(self, t: int, j: np.ndarray, i: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Time of segments [j, i) of type t when the busiest instance holds q episodes
        (inf where the type cannot serve the segment)."""
        j, i, q = np.broadcast_arrays(np.asarray(j), np.asarray(i), np.asarray(q, dtype=float))
        idx = (j, i)
        out = np.maximum(self._work(t, q, idx), self._crit(t, q, idx))
        return np.where(self.bcap[t][idx] > 0, out, _INF)

    def time(self, t: int, j: int, i: int, m: int) -> float:
        """Time of segment [j, i) on m instances of type t (0 for an empty segment)."""
        if j >= i:
            return 0.0
        if m <= 0:
            return _INF
        n = int(self.n[j, i])
        q = -(-n // m)
        return float(self.time_q(t, np.array(j), np.array(i), np.array(float(q))))

    def times_at(self, t: int, m: int) -> np.ndarray:
        """T[j, i] with m instances of type t (0 on the diagonal, inf below it)."""
        q = np.ceil(self.n / max(m, 1))
        out = self.time_q(t, self._j, self._i, np.maximum(q, 1.0))
        if m <= 0:
            out = np.full_like(out, _INF)
        np.fill_diagonal(out, 0.0)
        return np.where(self.valid | np.eye(self.nb + 1, dtype=bool), out, _INF)

    def time_table(self, t: int, max_m: int) -> np.ndarray:
        """T[j, i, m] for m = 0..max_m (m = 0: 0 for empty segments, inf otherwise)."""
        nb = self.nb
        m = np.arange(max_m + 1, dtype=float)
        q = np.ceil(self.n[:, :, None] / np.maximum(m[None, None, :], 1.0))
        j = np.broadcast_to(self._j[:, :, None], q.shape)
        i = np.broadcast_to(self._i[:, :, None], q.shape)
        out = self.time_q(t, j, i, np.maximum(q, 1.0))
        out[:, :, 0] = _INF
        diag = np.arange(nb + 1)
        out[diag, diag, :] = 0.0
        out[~self.valid & ~np.eye(nb + 1, dtype=bool)] = _INF
        return out

    # --- inversion ----------------------------------------------------------------------
    def max_load(self, t: int, tau: float, *, strict: bool = False) -> np.ndarray:
        """Largest q (episodes on the busiest instance) with time <= tau (< tau when
        strict), per segment; 0 where even one episode per instance is too slow."""
        live = self.bcap[t] > 0
        xw, risk_w = self._q_work(t, tau, strict)
        xc, risk_c = self._q_crit(t, tau, strict)
        x = np.minimum(xw, xc)
        q = np.where(live, np.clip(np.floor(x), 0.0, self.n), 0.0)
        with np.errstate(invalid="ignore"):
            near = np.isfinite(x) & (np.abs(x - np.round(x)) <= 1e-7 * np.maximum(1.0, np.abs(x)))
        risky = live & (risk_w | risk_c | near)
        if risky.any():
            q[risky] = self._settle(t, tau, np.nonzero(risky), q[risky], strict)
        return q

    def min_instances(self, t: int, tau: float, *, strict: bool = False) -> np.ndarray:
        """Fewest instances of type t meeting tau per segment (inf if none; 0 if empty)."""
        q = self.max_load(t, tau, strict=strict)
        m = np.where(q >= 1.0, np.ceil(self.n / np.maximum(q, 1.0)), _INF)
        np.fill_diagonal(m, 0.0)
        return np.where(self.valid | self._diag, m, _INF)

    def _pre(self, t: int) -> dict[str, Any]:
        """Target-independent arrays of type t's inversion (computed once)."""
        if t in self._pre_cache:
            return self._pre_cache[t]
        ic = self.types[t]
        n = np.maximum(self.n, 1.0)
        g, k, p = self.gen / n, self.kv / n, self.pf[t] / n  # per-episode means
        bcap = np.maximum(self.bcap[t], 1.0)
        cs, ct, kvt = ic.comm_step_s, ic.comm_per_token_s, ic.kv_time_per_token
        cmp_unit = g * ic.cmp_per_token_s + k * ic.cmp_per_pair_s
        # Work bound beyond the batch cap: every term grows linearly with q (slope c2).
        c2 = np.maximum(g * self._wread(t, bcap) / bcap + k * kvt, cmp_unit)
        c2 = c2 + g * cs / bcap + g * ct + p
        r = self.ctx_res
        pre: dict[str, Any] = {
            "g": g,
            "k": k,
            "p": p,
            "bcap": bcap,
            "cmp_unit": cmp_unit,
            "at_cap": bcap * c2,
            "inv_c2": 1.0 / np.maximum(c2, 1e-300),
            "step_cap": self._step(t, bcap, r),
        }
        if not ic.experts:
            w = ic.dense_read_s
            pre |= {
                # work below the cap: q <= (tau - off) * inv
                "wa_off": g * (w + cs),
                "wa_inv": 1.0 / np.maximum(k * kvt + g * ct + p, 1e-300),
                "wb_off": g * cs,
                "wb_inv": 1.0 / np.maximum(cmp_unit + g * ct + p, 1e-300),
                # critical path: batch <= (s* - off) * inv
                "ca_off": w + cs,
                "ca_inv": 1.0 / np.maximum(r * kvt + ct, 1e-300),
                "cb_off": cs,
                "cb_inv": 1.0 / np.maximum(ic.cmp_per_token_s + r * ic.cmp_per_pair_s + ct, 1e-300),
            }
        else:
            # MoE: expert reads grow as a power of the batch, so tabulate the work bound and
            # the step time for every batch up to max_num_seqs and count (both monotone).
            size = len(self._wread_table[t])
            qs = np.arange(1, size, dtype=float)[None, None, :]
            over = qs > bcap[:, :, None]
            j3, i3 = self._j[:, :, None], self._i[:, :, None]
            pre["work_tab"] = np.where(over, _INF, self._work(t, qs, (j3, i3)))
            pre["step_tab"] = np.where(over, _INF, self._step(t, qs, r[:, :, None]))
        pj, pi, pb = self._pj, self._pi, self._pb
        gm_p = self.gen_max[pb]
        pre |= {
            "p_gm": gm_p,
            "p_step_cap": pre["step_cap"][pj, pi],
            # batch = 1 + (q - 1) x mean / gen_max[b], but never above q (a bin whose
            # longest episode is shorter than the segment's mean decodes in a batch of q):
            # batch <= a holds up to q = 1 + (a - 1) x p_scale
            "p_scale": np.maximum(gm_p / np.maximum(g[pj, pi], 1e-30), 1.0),
        }
        if ic.experts:
            pre["p_step_tab"] = pre["step_tab"][pj, pi]
        else:
            pre |= {"p_ca_inv": pre["ca_inv"][pj, pi], "p_cb_inv": pre["cb_inv"][pj, pi]}
        self._pre_cache[t] = pre
        return pre

    def _q_work(self, t: int, tau: float, strict: bool) -> tuple[np.ndarray, np.ndarray]:
        """Largest load (unfloored) the work bound allows, and where rounding is risky."""
        ic, pre = self.types[t], self._pre(t)
        bcap, at_cap = pre["bcap"], pre["at_cap"]
        if ic.experts:
            tab = pre["work_tab"]
            below = ((tab < tau) if strict else (tab <= tau)).sum(axis=-1) + 0.5  # exact count
        else:
            below = np.minimum(
                (tau - pre["wa_off"]) * pre["wa_inv"], (tau - pre["wb_off"]) * pre["wb_inv"]
            )
        fits_cap = (at_cap < tau) if strict else (at_cap <= tau)
        x = np.where(fits_cap, np.maximum(tau * pre["inv_c2"], bcap), np.minimum(below, bcap))
        return x, np.abs(at_cap - tau) <= 1e-9 * tau

    def _q_crit(self, t: int, tau: float, strict: bool) -> tuple[np.ndarray, np.ndarray]:
        """Largest load (unfloored) the critical path allows, and where rounding is risky.

        Bin b's line allows the step time lim_b = (tau - other_max[b]) / gen_max[b]; it
        does not bind when a full batch's step fits it, else the batch allowed a_b (>= 1,
        or nothing fits) bounds the load at 1 + (a_b - 1) x max(1, gen_max[b] / mean
        generated).
        Evaluated on (bin, segment) pairs and reduced per segment."""
        ic, pre = self.types[t], self._pre(t)
        gm, om = self.gen_max, self.other_max[t]
        with np.errstate(divide="ignore", invalid="ignore"):
            lim = np.where(gm > 0, (tau - om) / gm, np.where(om <= tau, _INF, -_INF))
        pb = self._pb
        lim_p = lim[pb]
        at_cap = pre["p_step_cap"]
        free = ((at_cap < lim_p) if strict else (at_cap <= lim_p)) | (pre["p_gm"] <= 0)
        if ic.experts:
            tab = pre["p_step_tab"]  # (pairs, batches): monotone in the batch
            ok = (tab < lim_p[:, None]) if strict else (tab <= lim_p[:, None])
            c = ok.sum(axis=-1)
            # Between whole batches the forward step interpolates the expert reads, so
            # the batch allowed lies in [c, c + 1): the chord through the two whole
            # batches' steps puts it close (the step is convex between them, so the
            # chord's answer is at or below the true one), and where a line binds the
            # forward function settles the load.
            rows = np.arange(len(c))
            width = tab.shape[-1]
            prev = tab[rows, np.clip(c - 1, 0, width - 1)]
            nxt = tab[rows, np.clip(c, 0, width - 1)]
            with np.errstate(divide="ignore", invalid="ignore"):
                frac = np.where(
                    (c >= 1) & (c < width) & np.isfinite(nxt) & (nxt > prev),
                    (lim_p - prev) / (nxt - prev),
                    0.0,
                )
            a = c + np.clip(frac, 0.0, 1.0 - 1e-9)
            edge = ~free & (a >= 1.0)
        else:
            a = np.minimum(
                (lim_p - pre["ca_off"]) * pre["p_ca_inv"], (lim_p - pre["cb_off"]) * pre["p_cb_inv"]
            )
            # at a boundary: a full batch just fits, or a batch of one just does
            edge = (np.abs(at_cap - lim_p) <= 1e-9 * np.abs(at_cap)) | (np.abs(a - 1.0) <= 1e-7)
        with np.errstate(invalid="ignore", over="ignore"):
            bound = np.where(a >= 1.0, 1.0 + (a - 1.0) * pre["p_scale"], -_INF)
        bound = np.where(free, np.where(lim_p >= 0, _INF, -_INF), bound)
        x = np.full(self.valid.shape, _INF)
        x[self._seg_j, self._seg_i] = np.minimum.reduceat(bound, self._starts)
        risk = np.zeros(self.valid.shape, dtype=bool)
        risk[self._seg_j, self._seg_i] = np.logical_or.reduceat(edge, self._starts)
        return x, risk

    def _settle(
        self, t: int, tau: float, idx: tuple[np.ndarray, ...], q: np.ndarray, strict: bool
    ) -> np.ndarray:
        """Move q to where the forward function says the boundary is (a few entries)."""
        j, i = idx
        n = self.n[idx]

        def ok(qq: np.ndarray) -> np.ndarray:
            tm = self.time_q(t, j, i, np.maximum(qq, 1.0))
            return (tm < tau) if strict else (tm <= tau)

        for _ in range(3):
            down = (q >= 1) & ~ok(q)
            up = ~down & (q < n) & ok(q + 1)
            if not (down.any() or up.any()):
                return q
            q = q - down + up
        # Still moving: the closed form was far off here; bisect on the forward function.
        return _bisect(lambda qq: np.where(ok(qq), 0.0, 1.0), 0.5, n, False)


def _range_max(values: np.ndarray, nb: int) -> np.ndarray:
    """R[j, i] = max(values[j:i]) (0 for empty ranges)."""
    out = np.zeros((nb + 1, nb + 1))
    for j in range(nb):
        out[j, j + 1 :] = np.maximum.accumulate(values[j:])
    return out


def _bisect(
    f: Callable[[np.ndarray], np.ndarray], target: np.ndarray | float, top: np.ndarray, strict: bool
) -> np.ndarray:
    """Largest integer x in [1, top] with f(x) <= target (< when strict), elementwise, for
    a non-decreasing f; 0 where even f(1) fails."""
    top = np.maximum(np.floor(top), 1.0)
    target = np.broadcast_to(target, top.shape)

    def good(x: np.ndarray) -> np.ndarray:
        return (f(x) < target) if strict else (f(x) <= target)

    lo, hi = np.ones_like(top), top.copy()
    for _ in range(int(np.ceil(np.log2(float(np.max(top)) + 1.0))) + 1):
        mid = np.floor((lo + hi + 1.0) / 2.0)
        g = good(mid)
        lo = np.where(g & (lo < hi), mid, lo)
        hi = np.where(~g & (lo < hi), mid - 1.0, hi)
    return np.where(good(np.ones_like(top)), lo, 0.0)


__all__ = ["SegmentModel"]
