"""Oracle-scored trace families: episodes drawn from a law that is written down, and the
Bayes oracle that routes by it (issue 17).

    law = law_of("oracle-search", {"long_payload": 300.0})
    batch = sample_oracle(law, n_prompts=64, group=16, step=3, seed=0)   # record dicts
    oracle = OraclePolicy(law, seed=0, buckets)                           # a RoutingPolicy

**The law.** A prompt `p` (one of `dataset_size`, drawn uniformly each step) has a
latent propensity `q_p ~ Beta(long_a, long_b)` (fixed by the seed), drifting by `drift`
per training step (`q_p(step) = clip(q_p + drift * step, 0.02, 0.98)`). Each episode of
`p` is *long* with probability `q_p(step)`, else *short*. Its number of model turns is
`1 + min(Poisson(short_turns | long_turns), max_turns - 1)`. Every turn generates
`LogNormal(model_median, model_sigma)` tokens; every turn but the last ends in one tool
call whose return is an `error` with probability `short_error | long_error` and carries
`LogNormal(short_payload | long_payload, payload_sigma)` tokens (plus `template_tokens`
of chat template). The prompt has `LogNormal(prompt_median, prompt_sigma)` tokens. The
context is capped at `max_context` (the episode is then `truncated`).

**What the router sees**, and so what the oracle conditions on: the prompt (its id, so
its `q_p` — a router may learn it from the prompt's earlier episodes), the training step,
the tool returns so far (tool, status, *raw* payload size), their number, and the current
length. Model tokens per turn have the same law for both classes, so the current length
adds nothing beyond the returns. The tree keys on payload *size classes* (≤ 500, ≤ 5,000,
above): where the two classes' payloads straddle a threshold, raw sizes carry signal the
tree cannot see; `drift` makes old statistics stale.

**The oracle.** At the start and at every tool return: the posterior of the episode's
class given the returns (prior `q_p(step)`, times the chance of having reached `t`
returns, times each return's likelihood: status and log-normal payload density), and,
for each class, the distribution of the remaining tokens after `t` returns (a Monte Carlo
table of `table_samples` draws per class and `t`, made once from the law). P(final
bucket | information) mixes the two; the oracle moves to the most probable bucket (a tie
keeps the current one), once: single-shot accuracy counts an episode moved at most once,
so after its first move it stays (the rule of issue 17 with that one consequence of the
metric; the best single decision at each point, not an optimal plan over the episode).

Two families, each with held-out siblings made by other seeds and `params`:
`oracle-search` (short search-like episodes, a strong payload signal straddling the small
threshold) and `oracle-swe` (long SWE-like episodes, a weak signal). Their parameters are
docs/cmlfq.md's, "Oracle-scored families"; nothing in them was fitted to a policy.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from libra.errors import ConfigError
from libra.routing.base import Bucket, Decision, EpisodeState, smallest_fitting

TOOL = "search"


@dataclass(frozen=True, slots=True)
class OracleLaw:
    name: str
    dataset_size: int
    long_a: float
    long_b: float
    drift: float
    short_turns: float
    """Poisson mean of a short episode's tool calls (turns - 1)."""
    long_turns: float
    max_turns: int
    model_median: float
    model_sigma: float
    short_payload: float
    long_payload: float
    payload_sigma: float
    short_error: float
    long_error: float
    prompt_median: float
    prompt_sigma: float
    template_tokens: int = 10
    max_context: int = 40_960
    table_samples: int = 4_000

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FAMILIES: dict[str, OracleLaw] = {
    f.name: f
    for f in (
        OracleLaw(
            name="oracle-search", dataset_size=512, long_a=1.2, long_b=1.8, drift=-0.01,
            short_turns=1.2, long_turns=12.0, max_turns=24, model_median=900.0,
            model_sigma=0.5, short_payload=700.0, long_payload=250.0, payload_sigma=0.6,
            short_error=0.03, long_error=0.15, prompt_median=260.0, prompt_sigma=0.2,
        ),
        OracleLaw(
            name="oracle-swe", dataset_size=256, long_a=2.0, long_b=2.0, drift=0.01,
            short_turns=3.0, long_turns=12.0, max_turns=40, model_median=450.0,
            model_sigma=0.6, short_payload=900.0, long_payload=1400.0, payload_sigma=0.9,
            short_error=0.2, long_error=0.35, prompt_median=1500.0, prompt_sigma=0.3,
        ),
    )
}  # fmt: skip


def law_of(name: str, params: Mapping[str, Any] | None = None) -> OracleLaw:
    """A family's law with `params` overriding its fields."""
    try:
        law = FAMILIES[name]
    except KeyError:
        raise ConfigError(f"unknown oracle family {name!r}; known: {', '.join(FAMILIES)}") from None
    fields = {f.name: f for f in dataclasses.fields(law)}
    for key, value in (params or {}).items():
        if key not in fields or key == "name":
            raise ConfigError(f"{name}: no numeric field {key!r}; fields: {', '.join(fields)}")
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ConfigError(f"{name}: {key} must be a number (got {value!r})")
        if isinstance(getattr(law, key), int) and not float(value).is_integer():
            raise ConfigError(f"{name}: {key} must be an integer (got {value!r})")
    cast = {k: type(getattr(law, k))(v) for k, v in (params or {}).items()}
    return dataclasses.replace(law, **cast)


def law_from_dict(doc: Mapping[str, Any]) -> OracleLaw:
    try:
        return OracleLaw(**doc)
    except TypeError as e:
        raise ConfigError(f"not an oracle law: {e}") from None


def propensities(law: OracleLaw, seed: int) -> np.ndarray:
    """q_p for every prompt of the dataset (fixed by the seed)."""
    return np.random.default_rng([seed, 17]).beta(law.long_a, law.long_b, law.dataset_size)


def p_long(law: OracleLaw, q: float, step: int) -> float:
    return min(0.98, max(0.02, q + law.drift * step))


def sample_oracle(
    law: OracleLaw, n_prompts: int, group: int, *, step: int, seed: int
) -> list[dict[str, Any]]:
    """One step's batch as trajectory-record dicts (the fields routing replay reads)."""
    q = propensities(law, seed)
    rng = np.random.default_rng([seed, step, 29])
    prompts = rng.choice(law.dataset_size, size=min(n_prompts, law.dataset_size), replace=False)
    out = []
    for p in prompts:
        task = f"{law.name}-{int(p)}"
        prompt_tokens = int(rng.lognormal(math.log(law.prompt_median), law.prompt_sigma))
        for k in range(group):
            long = bool(rng.random() < p_long(law, float(q[p]), step))
            out.append(_episode(law, rng, task, step, k, prompt_tokens, long))
    return out


def _episode(
    law: OracleLaw, rng: np.random.Generator, task: str, step: int, k: int, prompt: int, long: bool
) -> dict[str, Any]:
    calls = min(int(rng.poisson(law.long_turns if long else law.short_turns)), law.max_turns - 1)
    turns, ctx, status = [], prompt, "ok"
    for i in range(calls + 1):
        model = max(1, int(rng.lognormal(math.log(law.model_median), law.model_sigma)))
        returns, tool_tokens = [], 0
        if i < calls:
            err = rng.random() < (law.long_error if long else law.short_error)
            median = law.long_payload if long else law.short_payload
            payload = max(1, int(rng.lognormal(math.log(median), law.payload_sigma)))
            returns.append({"tool": TOOL, "status": "error" if err else "ok",
                            "payload_tokens": payload, "latency_s": 0.0})  # fmt: skip
            tool_tokens = payload + law.template_tokens
        if ctx + model + tool_tokens >= law.max_context:
            model = max(0, min(model, law.max_context - ctx))
            turns.append(_turn(ctx - prompt, model, 0, step))
            ctx += model
            status = "truncated"
            break
        turns.append(_turn(ctx - prompt, model, tool_tokens, step, returns))
        ctx += model + tool_tokens
    return {
        "id": f"{task}/s{step}/{k}", "batch_id": f"step-{step}", "task_id": task,
        "group_id": f"{task}/s{step}", "env": law.name, "step": step, "status": status,
        "prompt_tokens": prompt, "total_tokens": ctx, "turns": turns,
    }  # fmt: skip


def _turn(
    start: int, model: int, tool: int, step: int, returns: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {"start": start, "model_tokens": model, "tool_tokens": tool, "bucket": "",
            "endpoint": "", "policy_version": step, "tool_returns": returns or []}  # fmt: skip


# --- the oracle -----------------------------------------------------------------------
def _poisson_sf(lam: float, t: int, cap: int) -> float:
    """P(min(Poisson(lam), cap) >= t)."""
    if t <= 0:
        return 1.0
    if t > cap:
        return 0.0
    below = sum(math.exp(-lam) * lam**j / math.factorial(j) for j in range(t))
    return max(0.0, 1.0 - below)


class OraclePolicy:
    """The Bayes oracle of an `OracleLaw` (see the module docstring); a RoutingPolicy."""

    name = "oracle"

    def __init__(self, law: OracleLaw, seed: int, buckets: Sequence[Bucket]):
        self.law = law
        self.q = propensities(law, seed)
        self.buckets = tuple(sorted(buckets, key=lambda b: b.bound))
        self.step = 0
        self._moved: set[str] = set()
        self._tables = self._remaining_tables()

    def _remaining_tables(self) -> dict[tuple[bool, int], np.ndarray]:
        """Sorted samples of the tokens still to come after `t` tool returns (the
        episode had more than `t - 1` calls), per class: the next model turn, and the
        calls and turns after it, drawn from the law."""
        law, rng = self.law, np.random.default_rng(12345)
        tables = {}
        for long in (False, True):
            lam = law.long_turns if long else law.short_turns
            cap = law.max_turns - 1
            for t in range(cap + 1):
                n = law.table_samples
                calls = np.minimum(rng.poisson(lam, size=n * 8), cap)
                calls = calls[calls >= t][:n]  # episodes that made at least t calls
                if calls.size == 0:
                    tables[(long, t)] = np.zeros(1)
                    continue
                more_calls = calls - t  # calls after the t-th return
                turns = more_calls + 1  # model turns still to come
                mu, sig = math.log(law.model_median), law.model_sigma
                pay = math.log(law.long_payload if long else law.short_payload)
                sig_p, tpl = law.payload_sigma, law.template_tokens
                rem = np.array([
                    rng.lognormal(mu, sig, size=int(k)).sum()
                    + (rng.lognormal(pay, sig_p, size=int(c)) + tpl).sum()
                    for k, c in zip(turns, more_calls, strict=True)
                ])  # fmt: skip
                tables[(long, t)] = np.sort(rem)
        return tables

    def _class_posterior(self, task_id: str, returns: Sequence[Any]) -> float:
        """P(long | prompt, step, the returns so far)."""
        law = self.law
        try:
            q = float(self.q[int(task_id.rsplit("-", 1)[1])])
        except (IndexError, ValueError):
            q = law.long_a / (law.long_a + law.long_b)
        prior = p_long(law, q, self.step)
        t = len(returns)
        logw = []
        for long, pr in ((False, 1.0 - prior), (True, prior)):
            lam = law.long_turns if long else law.short_turns
            lw = math.log(max(pr, 1e-300)) + math.log(
                max(_poisson_sf(lam, t, law.max_turns - 1), 1e-300)
            )
            p_err = law.long_error if long else law.short_error
            mu = math.log(law.long_payload if long else law.short_payload)
            for r in returns:
                lw += math.log(p_err if r.status != "ok" else 1.0 - p_err)
                x = max(1, r.payload_tokens)
                z = (math.log(x) - mu) / law.payload_sigma
                lw += -0.5 * z * z - math.log(x * law.payload_sigma)
            logw.append(lw)
        m = max(logw)
        w = [math.exp(v - m) for v in logw]
        return w[1] / (w[0] + w[1])

    def probs(self, state: EpisodeState) -> list[float]:
        """P(final bucket = b | what the router sees) for each bucket."""
        p_l = self._class_posterior(state.task_id, state.tool_returns)
        t = min(len(state.tool_returns), self.law.max_turns - 1)
        ctx = state.tokens_so_far
        out = [0.0] * len(self.buckets)
        for long, w in ((False, 1.0 - p_l), (True, p_l)):
            table = self._tables[(long, t)]
            below = 0.0
            for i, b in enumerate(self.buckets):
                if i == len(self.buckets) - 1:
                    upto = 1.0
                else:
                    upto = bisect.bisect_right(table, b.bound - ctx) / len(table)
                out[i] += w * max(0.0, upto - below)
                below = max(below, upto)
        return out

    def _best(self, state: EpisodeState) -> Bucket:
        best, best_p = self.buckets[-1], -1.0
        for b, p in zip(self.buckets, self.probs(state), strict=True):
            if p > best_p + 1e-12 or (abs(p - best_p) <= 1e-12 and b.name == state.bucket):
                best, best_p = b, p
        return best

    # --- the RoutingPolicy protocol ------------------------------------------------
    def on_start(self, state: EpisodeState) -> str:
        target = self._best(state)
        if target.bound < state.prompt_tokens:
            return smallest_fitting(self.buckets, state.prompt_tokens)
        return target.name

    def on_tool_return(self, state: EpisodeState) -> str | Decision:
        if state.episode_id in self._moved:  # a second move can only lose single-shot
            return state.bucket
        target = self._best(state)
        if target.name == state.bucket or target.bound <= state.tokens_so_far:
            return state.bucket
        self._moved.add(state.episode_id)
        return Decision(target.name, "oracle")

    def on_finish(self, record: Any) -> None:
        self._moved.discard(getattr(record, "id", ""))

    def end_step(self, step: int | None = None) -> None:
        if step is not None:
            self.step = step + 1


__all__ = ["FAMILIES", "OracleLaw", "OraclePolicy", "law_from_dict", "law_of", "sample_oracle"]
