"""One episode: model turn -> tool calls -> tool returns -> routing hook -> ... -> reward.

Token-in, token-out. The opening prompt is rendered once; after each tool call only the
rendered delta of the tool messages plus the generation prompt is appended (loss mask 0,
logprob 0.0). The history is never re-rendered. Every failure inside the episode ends up
on the record (`status`, `error`) and never escapes: a bad rollout is data, not a crash.
Cancellation (batch cancelled) ends the episode `aborted`, records it, and re-raises.

Timeout scopes nest: episode (`limits.episode_timeout_s`) ⊃ turn (`turn_timeout_s`, all
retries of one model turn) ⊃ call (`endpoint.request_timeout_s`) and tool (the tool's own
timeout, capped by `tool_timeout_s`).

Nothing proportional to a payload runs on the event loop: the env's hooks (prompt,
setup, reward, teardown) and the tools run through `libra.usercode` (a plain function in
a worker thread, a coroutine in a task of its own whose limit holds even if it swallows
cancellation); a prompt that cannot fit is refused from its length alone; big prompts
and tool returns are tokenized in worker threads (`libra.rollout.offload`), tool text
being cut to `limits.max_tool_output_bytes` first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from libra import usercode
from libra.chat import ChatTokenizer
from libra.endpoints.config import SamplingConfig
from libra.endpoints.pool import BucketDown, EndpointPool, Served
from libra.env import Env, overrides, reward_wants_context
from libra.errors import EndpointError
from libra.record import ENDPOINT_ERROR, Migration, Timings, ToolCall, ToolReturn, Trajectory, Turn
from libra.rollout.config import LimitsConfig
from libra.rollout.deadlines import Deadlines
from libra.rollout.inputs import check_prompt, own_task
from libra.rollout.offload import offload, text_size
from libra.rollout.reward import as_reward, plain, score
from libra.rollout.toolrun import CallOutcome, encode_returns, run_calls
from libra.routing.base import Decision, EpisodeState, RoutingPolicy, ToolState
from libra.toolcalls import ToolCallParser, parser_for
from libra.tooling import Context, Tool

log = logging.getLogger("libra.rollout")

SCHEMA_CACHE = 1024
"""Sets of tools whose schemas a runner keeps (an env whose `tools_for` makes new tools
for every task would otherwise grow it without end)."""
_ToolSet = tuple[tuple[Tool, ...], dict[str, Tool], list[dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class EpisodeSpec:
    """What to run: identity + task. `index` seeds sampling when a seed is configured."""

    id: str
    batch_id: str
    task_id: str
    group_id: str
    task: dict[str, Any]
    index: int = 0
    step: int = 0


class _Ended(Exception):
    """Internal: the episode ended early with this status."""

    def __init__(self, status: str, error: str | None = None):
        super().__init__(error or status)
        self.status = status
        self.error = error


@dataclass(slots=True)
class _TurnDraft:
    """A turn while its episode runs; the record's `Turn` (a pydantic model: a dict, a
    set and two lists besides itself, and as many again per tool call) is built once, at
    the end, so that suspended episodes hold few objects for the garbage collector."""

    start: int
    model_tokens: int
    bucket: str
    endpoint: str
    policy_version: int
    finish_reason: str | None
    tool_tokens: int = 0
    calls: tuple[tuple[str, dict[str, Any]], ...] = ()
    """(name, arguments) per tool call."""
    returns: tuple[tuple[str, str, int, float, Any], ...] = ()
    """(tool, status, payload tokens, latency s, info) per tool return."""

    def turn(self) -> Turn:
        return Turn(
            start=self.start,
            model_tokens=self.model_tokens,
            tool_tokens=self.tool_tokens,
            bucket=self.bucket,
            endpoint=self.endpoint,
            policy_version=self.policy_version,
            finish_reason=self.finish_reason,
            tool_calls=[ToolCall(name=n, arguments=a) for n, a in self.calls],
            tool_returns=[
                ToolReturn(tool=t, status=s, payload_tokens=p, latency_s=lat, info=i)
                for t, s, p, lat, i in self.returns
            ],
        )


@dataclass(slots=True)
class _State:
    """Mutable per-episode bookkeeping, turned into a Trajectory at the end.

    Kept small for the garbage collector, which walks every tracked object of every
    suspended episode on each full pass: token ids, mask and log-probs live in typed
    arrays (not walked item by item as a list of ints is), the context is the prompt
    followed by the response (one array, `prompt_len` splits it), and what most episodes
    never fill (migrations) is created on first use."""

    spec: EpisodeSpec
    bucket: str = ""
    prompt_len: int = -1
    """Tokens of the rendered prompt; -1 until the prompt is rendered."""
    context: array[int] = field(default_factory=lambda: array("i"))
    mask: array[int] = field(default_factory=lambda: array("b"))
    logprobs: array[float] = field(default_factory=lambda: array("d"))
    turns: list[_TurnDraft] = field(default_factory=list)
    migrations: list[Migration] | None = None
    tool_states: tuple[ToolState, ...] = ()
    tools: dict[str, Tool] = field(default_factory=dict)
    """The task's tools by name (`env.tools_for`, asked once when the episode opens)."""
    schemas: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    answer: str | None = None
    queued_s: float = 0.0
    generate_s: float = 0.0
    tool_s: float = 0.0

    @property
    def response_len(self) -> int:
        return len(self.context) - self.prompt_len

    def append(self, ids: Sequence[int], lps: Sequence[float] | None, model: bool) -> None:
        self.context.extend(ids)
        self.mask.extend(array("b", (1 if model else 0,)) * len(ids))
        self.logprobs.extend(lps if lps is not None else array("d", (0.0,)) * len(ids))


class EpisodeRunner:
    """Runs episodes of one env against one endpoint pool; shared by a whole batch."""

    def __init__(
        self,
        *,
        env: Env,
        env_name: str,
        tokenizer: ChatTokenizer,
        pool: EndpointPool,
        policy: RoutingPolicy,
        sampling: SamplingConfig,
        limits: LimitsConfig,
        max_context: int,
        parser: ToolCallParser | None = None,
        cpu_slots: int = 32,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.env = env
        self.env_name = env_name
        self.tok = tokenizer
        self._offload = offload(tokenizer)
        self.pool = pool
        self.policy = policy
        self.sampling = sampling
        self.limits = limits
        # What the endpoints can serve at all: the largest bucket's bound.
        self.max_context = min(max_context, max(b.bound for b in pool.buckets))
        self.max_turns = limits.max_turns or env.max_turns
        self.parser = parser or parser_for(env.tool_parser, tokenizer.chat_template)
        self.clock = clock
        self._buckets = {b.name: b for b in pool.buckets}
        self._reward_ctx = reward_wants_context(env)
        # Env's own setup and teardown do nothing: an env that keeps them is spared two
        # user-code hand-offs (a task each) per episode.
        self._setup = overrides(env, "setup")
        self._teardown_hook = overrides(env, "teardown")
        self._own_parse = overrides(env, "parse_answer")
        self._own_tools = overrides(env, "tools_for")
        # Turn ends: the end-of-turn token(s), plus env stop strings; a stop string that
        # is one token goes in stop_token_ids (vLLM matches stop strings on decoded text
        # only, which misses special tokens).
        self.stop_ids = list(tokenizer.eos_token_ids)
        self.stop_strs: list[str] = []
        for s in env.stop:
            tid = tokenizer.token_id(s)
            if tid is not None:
                self.stop_ids.append(tid)
            else:
                self.stop_strs.append(s)
        self._schemas: dict[tuple[int, ...], _ToolSet] = {}
        # CPU gate: at most `cpu_slots` episodes do synchronous work (render, tokenize,
        # parse) per event-loop iteration, so timers and I/O stay responsive when
        # thousands of episodes are in flight (waiters wake one loop iteration later).
        self._cpu = asyncio.Semaphore(cpu_slots)
        # The episode and turn timeouts of every episode, on one timer (see deadlines).
        self._deadlines = Deadlines()

    async def _tools(self, task: dict[str, Any]) -> tuple[dict[str, Tool], list[dict[str, Any]]]:
        """The task's tools by name, and their schemas (made once per set of tools). An
        env's own `tools_for` is user code: it runs in a worker thread under the turn's
        limit (on the loop, one that blocked 3 s held every episode 3 s). The
        key is the tools' identities, and the entry holds the tools, so an id cannot be
        reused while its entry lives (keyed by the id of the list `tools_for` returned,
        a fresh list of another task's tools got a freed list's entry: the prompt offered
        one tool, the call ran another)."""
        if self._own_tools:
            given = await usercode.call(self.env.tools_for, task,
                                        limit_s=self.limits.turn_timeout_s,
                                        what="env.tools_for")  # fmt: skip
        else:
            given = self.env.tools
        tools = tuple(given)
        if bad := [t for t in tools if not isinstance(t, Tool)]:
            raise TypeError(
                f"env.tools_for gave a {type(bad[0]).__name__}, not a tool; offer functions "
                "made tools with @libra.tool"
            )
        key = tuple(map(id, tools))
        if (entry := self._schemas.get(key)) is None:
            if len(self._schemas) >= SCHEMA_CACHE:
                self._schemas.pop(next(iter(self._schemas)))
            entry = self._schemas[key] = (tools, {t.name: t for t in tools},
                                          [t.schema for t in tools])  # fmt: skip
        return entry[1], entry[2]

    # --- the episode -----------------------------------------------------------------
    async def run(
        self,
        spec: EpisodeSpec,
        *,
        admitted_after_s: float = 0.0,
        on_abort: Callable[[Trajectory], None] | None = None,
    ) -> Trajectory:
        """Run one episode to its record. When cancelled, the partial episode is handed to
        `on_abort` as an `aborted` record and the cancellation propagates."""
        t0 = self.clock()
        spec = dataclasses.replace(spec, task=await own_task(spec.task, self._offload))
        ctx = Context(episode_id=spec.id, task=spec.task, env=self.env)
        st = _State(spec)
        try:
            record = await self._run(st, ctx)
        except asyncio.CancelledError:
            record = self._record(spec, st, "aborted", "cancelled")
            record.timings.queued_s += admitted_after_s
            record.timings.total_s = self.clock() - t0
            if on_abort is not None:
                on_abort(record)
            raise
        finally:
            await self._teardown(ctx)
        record.timings.queued_s += admitted_after_s
        record.timings.total_s = self.clock() - t0
        return record

    async def _run(self, st: _State, ctx: Context) -> Trajectory:
        spec = st.spec
        status, error = "ok", None
        try:
            async with self._deadlines.timeout(self.limits.episode_timeout_s):
                if self._setup:
                    await usercode.call(self.env.setup, ctx, limit_s=None, what="env.setup")
                await self._open(st)
                await self._loop(st, ctx)
        except _Ended as e:
            status, error = e.status, e.error
        except TimeoutError:
            status, error = "timeout", f"episode exceeded {self.limits.episode_timeout_s:g} s"
        except EndpointError as e:
            status, error = "error", f"{ENDPOINT_ERROR}{e}"
        except Exception as e:  # a bad rollout is data, not a crash
            log.debug("episode %s failed", spec.id, exc_info=True)
            status, error = "error", usercode.describe(e)
        record = self._record(spec, st, status, error)
        if status in ("ok", "truncated", "timeout") and st.prompt_len >= 0:
            await score(self.env, record, ctx, limit_s=self.limits.reward_timeout_s,
                        wants_context=self._reward_ctx)  # fmt: skip
        return record

    async def _open(self, st: _State) -> None:
        spec = st.spec
        messages = await usercode.call(self.env.prompt, spec.task, limit_s=None, what="env.prompt")
        check_prompt(messages)
        st.tools, st.schemas = await self._tools(spec.task)
        schemas = st.schemas
        size = text_size(messages)
        if (least := self.tok.min_tokens(size)) >= self.max_context:
            raise _Ended(
                "truncated",
                f"prompt of {size} characters (at least {least} tokens) does not fit the "
                f"context of {self.max_context}",
            )
        async with self._cpu:
            prompt_ids = await self._offload.run(
                size, lambda tok: tok.prompt_ids(messages, schemas or None)
            )
        if len(prompt_ids) >= self.max_context:
            raise _Ended(
                "truncated",
                f"prompt of {len(prompt_ids)} tokens does not fit the context "
                f"of {self.max_context}",
            )
        n = len(prompt_ids)
        state = EpisodeState(spec.id, spec.task_id, n, n, (), "", 0, tuple(prompt_ids))
        st.bucket = self.policy.on_start(state)
        st.context.extend(prompt_ids)
        st.prompt_len = n
        st.messages.extend(messages)

    async def _loop(self, st: _State, ctx: Context) -> None:
        tools, schemas = st.tools, st.schemas
        for turn_idx in range(self.max_turns):
            start = st.response_len
            served, finish = await self._model_turn(st, turn_idx)
            async with self._cpu:
                turn, content, closed = self._close_turn(st, start, served, finish)
            answer = await self._answer(content)
            async with self._cpu:
                calls = [] if answer is not None else self.parser.parse(content)
            if answer is not None:
                st.answer = answer
                return
            if not calls:
                if finish == "length":
                    raise _Ended("truncated", "model turn hit max_tokens without a tool call")
                return
            if turn_idx == self.max_turns - 1:
                raise _Ended("truncated", f"reached max_turns={self.max_turns}")
            outcomes = await run_calls(
                calls,
                ctx,
                tools,
                max_calls=self.limits.max_tool_calls_per_turn,
                timeout_cap_s=self.limits.tool_timeout_s,
                max_output_bytes=self.limits.max_tool_output_bytes,
                clock=self.clock,
            )
            async with self._cpu:
                await self._append_tools(st, turn, outcomes, schemas, closed)
                self._route(st, turn_idx + 1)
        raise _Ended("truncated", f"reached max_turns={self.max_turns}")

    async def _answer(self, content: str) -> str | None:
        """The env's answer in a turn's text. Libra's own parser runs here (linear in the
        text); an env's own `parse_answer` is user code, so it runs in a worker thread
        under the turn's limit, off the event loop."""
        if not self._own_parse:
            return self.env.parse_answer(content)
        try:
            answer = await usercode.call(self.env.parse_answer, content,
                                         limit_s=self.limits.turn_timeout_s,
                                         what="env.parse_answer")  # fmt: skip
        except usercode.LimitExceeded as e:
            raise _Ended("error", str(e)) from None
        if answer is not None and not isinstance(answer, str):
            raise TypeError(
                f"env.parse_answer returned a {type(answer).__name__}; "
                "return the answer's text or None"
            )
        return answer

    def _close_turn(
        self, st: _State, start: int, served: Served, finish: str | None
    ) -> tuple[_TurnDraft, str, bool]:
        model_ids = st.context[st.prompt_len + start :]
        content = self.tok.decode(model_ids)
        closed = bool(model_ids) and model_ids[-1] in self.tok.eos_token_ids
        if closed and self.tok.eos_token and content.endswith(self.tok.eos_token):
            content = content[: -len(self.tok.eos_token)]
        st.messages.append({"role": "assistant", "content": content})
        turn = _TurnDraft(
            start, len(model_ids), st.bucket, served.endpoint.url, served.version, finish
        )
        st.turns.append(turn)
        return turn, content, closed

    async def _model_turn(self, st: _State, turn_idx: int) -> tuple[Served, str | None]:
        """Generate one model turn. When the current bucket's bound (not the turn's token
        budget or the context) cuts the turn, it continues on a bucket with room
        (an overflow demotion)."""
        budget = self.sampling.max_tokens
        async with self._deadlines.timeout(self.limits.turn_timeout_s):
            while True:
                self._fit_bucket(st, turn_idx)
                room_ctx = self.max_context - len(st.context)
                if room_ctx <= 0:
                    raise _Ended("truncated", f"context reached max_context={self.max_context}")
                room_bucket = self._buckets[st.bucket].bound - len(st.context)
                max_tokens = min(budget, room_ctx, room_bucket)
                bucket_binds = room_bucket < min(budget, room_ctx)
                served = await self._generate(st, turn_idx, max_tokens)
                comp = served.completion
                st.append(comp.token_ids, comp.logprobs, model=True)
                budget -= len(comp.token_ids)
                if comp.finish_reason == "length" and bucket_binds and budget > 0:
                    continue  # `_fit_bucket` moves it to a bucket with room
                return served, comp.finish_reason

    def _fit_bucket(self, st: _State, turn_idx: int) -> None:
        """Force-move when the context no longer fits the current bucket's bound."""
        if len(st.context) < self._buckets[st.bucket].bound:
            return
        bigger = [b for b in self.pool.buckets if b.bound > len(st.context)]
        if not bigger:
            return  # the largest bucket: max_context decides
        self._move(st, turn_idx, bigger[0].name, "overflow")

    async def _generate(self, st: _State, turn_idx: int, max_tokens: int) -> Served:
        seed = self.sampling.seed
        if seed is not None:
            seed = seed + st.spec.index * 1009 + turn_idx
        while True:
            try:
                served = await self.pool.generate(
                    st.bucket,
                    st.context,
                    max_tokens=max_tokens,
                    temperature=self.sampling.temperature,
                    top_p=self.sampling.top_p,
                    logprobs=self.sampling.logprobs,
                    seed=seed,
                    stop=self.stop_strs,
                    stop_token_ids=self.stop_ids,
                )
            except BucketDown as e:
                fallback = self._fallback(st, e.bucket)
                if fallback is None:
                    raise
                self._move(st, turn_idx, fallback, "endpoint-down")
                continue
            st.queued_s += served.queued_s
            st.generate_s += served.generate_s
            return served

    def _fallback(self, st: _State, down: str) -> str | None:
        up = [b for b in self.pool.buckets if b.name != down and self.pool.has_healthy(b.name)]
        fits = [b for b in up if b.bound > len(st.context)]
        return fits[0].name if fits else None

    def _move(self, st: _State, turn_idx: int, to: str, reason: str) -> None:
        if to == st.bucket:
            return
        if st.migrations is None:
            st.migrations = []
        st.migrations.append(
            Migration(
                turn=turn_idx,
                from_bucket=st.bucket,
                to_bucket=to,
                reprefill_tokens=len(st.context),
                reason=reason,
            )
        )
        st.bucket = to

    async def _append_tools(
        self,
        st: _State,
        turn: _TurnDraft,
        outcomes: list[CallOutcome],
        schemas: list[dict[str, Any]],
        closed: bool,
    ) -> None:
        tool_msgs = [
            {"role": "tool", "name": o.call.name, "content": o.result.content} for o in outcomes
        ]
        payloads, delta = await self._offload.run(
            sum(len(m["content"]) for m in tool_msgs),
            lambda tok: encode_returns(tok, tool_msgs, schemas or None, closed),
        )
        infos: list[Any] = [o.result.info for o in outcomes]
        if any(infos):  # as JSON-safe data, in a thread: an info dict can be any size
            infos = await asyncio.to_thread(lambda: [plain(i) for i in infos])
        # One tuple each, built once: `+=` per call copied them (16,000 calls in a turn,
        # 2 tokens each, held the event loop for a second).
        st.tool_s += sum(o.latency_s for o in outcomes)
        turn.calls += tuple((o.call.name, o.call.arguments) for o in outcomes)
        turn.returns += tuple(
            (o.call.name, o.result.status, payload, o.latency_s, info)
            for o, payload, info in zip(outcomes, payloads, infos, strict=True)
        )
        st.tool_states += tuple(
            ToolState(o.call.name, o.result.status, payload)
            for o, payload in zip(outcomes, payloads, strict=True)
        )
        st.messages.extend(tool_msgs)
        if len(st.context) + len(delta) >= self.max_context:
            raise _Ended("truncated", f"tool output overflows max_context={self.max_context}")
        st.append(delta, None, model=False)
        turn.tool_tokens = len(delta)

    def _route(self, st: _State, next_turn: int) -> None:
        spec = st.spec
        state = EpisodeState(
            spec.id,
            spec.task_id,
            st.prompt_len,
            len(st.context),
            st.tool_states,
            st.bucket,
            next_turn,
        )
        decision = self.policy.on_tool_return(state)
        if isinstance(decision, Decision):
            to, reason = decision.bucket, decision.reason or "policy"
        else:
            to, reason = decision, "policy"
        if to not in self._buckets:
            raise ValueError(f"routing policy answered unknown bucket {to!r}")
        self._move(st, next_turn, to, reason)

    # --- the end ---------------------------------------------------------------------
    def _record(self, spec: EpisodeSpec, st: _State, status: str, error: str | None) -> Trajectory:
        rec = Trajectory(
            id=spec.id,
            batch_id=spec.batch_id,
            task_id=spec.task_id,
            group_id=spec.group_id,
            env=self.env_name,
            step=spec.step,
            status=status,
            error=error,
        )
        if st.prompt_len >= 0:  # the prompt was rendered
            rec.answer = st.answer
            rec.prompt_token_ids = st.context[: st.prompt_len].tolist()
            rec.prompt_tokens = st.prompt_len
            rec.response_token_ids = st.context[st.prompt_len :].tolist()
            rec.loss_mask = st.mask.tolist()
            rec.logprobs = st.logprobs.tolist()
            rec.total_tokens = len(st.context)
            rec.turns = [t.turn() for t in st.turns]
            rec.migrations = st.migrations or []
            rec.timings = Timings(queued_s=st.queued_s, generate_s=st.generate_s, tool_s=st.tool_s)
            rec._messages = st.messages
        return rec

    async def _teardown(self, ctx: Context) -> None:
        if not self._teardown_hook:
            return
        try:
            await usercode.call(self.env.teardown, ctx, limit_s=self.limits.teardown_timeout_s,
                                what="env.teardown")  # fmt: skip
        except Exception:
            log.warning("teardown of episode %s failed", ctx.episode_id, exc_info=True)


# For libra.train.demos, which scores expert demonstrations itself.
_as_reward = as_reward


async def _maybe_await(value: Any) -> Any:
    if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
        return await value
    return value


__all__ = ["EpisodeRunner", "EpisodeSpec"]
