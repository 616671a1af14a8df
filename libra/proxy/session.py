"""One agent episode as the proxy sees it: its token state, segments and model turns.

Every `/chat/completions` request of the episode goes through `Session.chat`, one at a
time (a lock; concurrent requests of one episode are served in arrival order):

1. The request's messages are put in canonical form (`messages.py`) and compared with
   the conversation the session holds (the previous request's messages + the reply it
   returned, with the previous request's tools).
2. First request: the messages are rendered once with the model's chat template (the
   opening prompt); the routing policy picks the first bucket (`on_start`).
   Extension (the common case): only the new messages are rendered, as a delta after
   the previous turn (`ChatTokenizer.delta_ids`), and appended with loss mask 0 — the
   model's tokens of earlier turns stay exactly as generated, nothing is re-rendered.
   Anything else (a message dropped or rewritten, tools changed) is a history edit: a
   new *segment* starts on a freshly rendered prompt, with the reason on the record.
3. Tool messages the agent sends after the model's calls become the previous turn's
   `tool_returns`; the routing policy sees them (`on_tool_return`) before the next turn,
   exactly as for a native env.
4. The turn is generated token-in/token-out on the bucket's endpoints (the native
   engine's rules: bucket-bound continuation, overflow moves, endpoint-down fallback);
   its ids, log-probs and loss mask 1 are appended; tool calls are parsed from Hermes
   `<tool_call>` blocks for the reply.

A failure that ends the episode (context full, `max_turns`, turn timeout, endpoint
failure) is kept as the episode's status and answered with an OpenAI error; every
later request of the episode gets the same answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

from libra.chat import ChatTokenizer
from libra.endpoints.pool import Served
from libra.errors import EndpointError
from libra.jsonlimits import MAX_DEPTH, deeper_than
from libra.proxy import messages as m
from libra.proxy.protocol import ChatRequest, ProxyError, Reply, bad_request
from libra.proxy.turns import ContextFull, Placement, Seg, Shared
from libra.record import ENDPOINT_ERROR, Segment, Timings, ToolCall, ToolReturn, Trajectory, Turn
from libra.rollout.episode import EpisodeSpec
from libra.rollout.offload import text_size
from libra.routing.base import Decision, EpisodeState, ToolState

log = logging.getLogger("libra.proxy")
_CALL_OPEN = "<tool_call>"


class Session:
    """One episode's conversation and tokens; `chat` serves its requests."""

    def __init__(self, spec: EpisodeSpec, shared: Shared):
        self.spec = spec
        self.sh = shared
        self.segments: list[Seg] = []
        self.turns: list[Turn] = []
        self.tool_states: list[ToolState] = []
        self.history: list[dict[str, Any]] = []
        """Canonical conversation: the last request's messages + the reply to it."""
        self.raw: list[Any] = []
        """The last request's messages as sent (a resent prefix is recognised by plain
        equality, so only new messages are put in canonical form)."""
        self.tools: list[dict[str, Any]] | None = None
        self.names: dict[str, str] = {}
        """Tool-call id -> tool name, for tool messages that carry only the id."""
        self.closed_turn = True
        self.last_calls: set[str] = set()
        self.last_text = ""
        self.last_finish: str | None = None
        self.replied_at = 0.0
        self.place = Placement(shared, spec.index)
        self.tool_s = 0.0
        self.ended: tuple[str, str] | None = None
        """(status, error) once something ended the episode."""
        self._ended_answer: ProxyError | None = None
        self._lock = asyncio.Lock()
        self._inflight: set[asyncio.Task[Any]] = set()
        self._closed = False

    # --- the request -----------------------------------------------------------------
    async def chat(self, req: ChatRequest) -> Reply:
        task = asyncio.current_task()
        if task is not None:
            self._inflight.add(task)
        try:
            async with self._lock:
                return await self._chat(req)
        finally:
            if task is not None:
                self._inflight.discard(task)

    async def _chat(self, req: ChatRequest) -> Reply:
        if self._closed:
            raise ProxyError(409, "this episode is over", "episode_ended")
        if self._ended_answer is not None:
            raise self._ended_answer
        turn_idx = len(self.turns)
        cap = self.sh.limits.max_turns
        if cap is not None and turn_idx >= cap:
            self._end("truncated", f"reached max_turns={cap}", 400, "max_turns_exceeded")
        start = -1
        try:
            async with self.sh.cpu:
                msgs = self._canonical(req.messages)
                await self._take(req, msgs, turn_idx)
            start = len(self.segments[-1].response)
            served, finish = await self.place.generate(
                self.segments[-1], turn_idx, req.max_tokens, req.stop
            )
            async with self.sh.cpu:
                return self._close_turn(req, msgs, start, served, finish)
        except m.BadMessages as e:
            raise bad_request(str(e), "invalid_messages") from None
        except ProxyError:
            raise
        except asyncio.CancelledError:  # the episode ended meanwhile: keep no half turn
            self._cut(start)
            raise
        except ContextFull as e:
            self._cut(start)
            self._end("truncated", str(e), 400, "context_length_exceeded")
        except TimeoutError:
            self._cut(start)
            limit = self.sh.limits.turn_timeout_s
            self._end("timeout", f"model turn exceeded {limit:g} s", 504, "turn_timeout")
        except EndpointError as e:
            self._cut(start)
            self._end("error", f"{ENDPOINT_ERROR}{e}", 502, "endpoint_error", "api_error")
        except Exception as e:
            log.debug("episode %s: request failed", self.spec.id, exc_info=True)
            self._cut(start)
            self._end("error", f"{type(e).__name__}: {e}", 500, "internal_error", "api_error")
        raise AssertionError("unreachable")  # pragma: no cover

    async def refuse_oversize(self, size: int) -> None:
        """End the episode `truncated` for a request body of `size` bytes, which cannot
        fit the context (`Shared.max_body`): refused unread, as parsing a body that big
        would hold the event loop up. Raises the agent's answer."""
        async with self._lock:
            if self._ended_answer is not None:
                raise self._ended_answer
            self._end("truncated", f"the request ({size} bytes) cannot fit the context of "
                      f"{self.sh.max_context} tokens", 400, "context_length_exceeded")  # fmt: skip

    def _canonical(self, raw: Any) -> list[dict[str, Any]]:
        n = len(self.raw)
        if n and isinstance(raw, list) and raw[:n] == self.raw:
            new = [m.canonical(x, i, self.names) for i, x in enumerate(raw[n:], n)]
            msgs = [*self.history[:n], *new]
        else:
            msgs = m.canonical_all(raw, self.names)
        return msgs

    def _cut(self, start: int) -> None:
        if start >= 0:
            self.segments[-1].cut(start)

    def _end(self, status: str, error: str, http: int, code: str, kind: str = "") -> None:
        self.ended = (status, error)
        self._ended_answer = ProxyError(
            http, f"episode ended ({status}): {error}", code, kind or "invalid_request_error"
        )
        raise self._ended_answer

    def close(self) -> None:
        """Freeze the session (the episode is being recorded): requests still in flight
        are cancelled, later ones refused."""
        self._closed = True
        me = asyncio.current_task()
        for task in list(self._inflight):
            if task is not me:
                task.cancel()

    # --- messages -> context -----------------------------------------------------------
    async def _take(self, req: ChatRequest, msgs: list[dict[str, Any]], turn_idx: int) -> None:
        """Render what the request adds and commit it (all checks come before any change).
        A text that cannot fit is refused from its length alone; big ones are tokenized
        in worker threads (`libra.rollout.offload`), never on the event loop."""
        tools = self.sh.intern_tools(req.tools)
        rendered = [m.render_form(x) for x in msgs]
        if self.segments and tools == self.tools and m.extends(self.history, msgs):
            new = rendered[len(self.history) :]
            idx = m.trailing_tools(msgs)
            seg = self.segments[-1]
            size = text_size(new)
            least = len(seg.context) + self.sh.tok.min_tokens(size)
            self._fits(least, "the new messages", at_least=True)
            closed = self.closed_turn

            def encode(tok: ChatTokenizer) -> tuple[list[ToolReturn], list[int]]:
                # the returns too: a tool message's status may read it whole as JSON
                payloads = [len(tok.encode(msgs[i]["content"])) for i in idx]
                returns = self._returns(req, msgs, idx, payloads)
                return returns, tok.delta_ids(new, tools, model_closed_turn=closed)

            returns, delta = await self.sh.offload.run(size, encode)
            self._fits(len(seg.context) + len(delta), "the new messages")
            seg.append(delta, None, model=False)
            self.turns[-1].tool_tokens += len(delta)
            self._commit_returns(returns, turn_idx)
            self.tools = tools
            return
        # The opening prompt, or an edited history: the whole conversation, rendered.
        what = "the prompt" if not self.segments else "the edited conversation"
        answered = []
        if self.segments:
            answered = [i for i in m.trailing_tools(msgs) if self._answers_last(req, i)]
        size = text_size(rendered)
        self._fits(self.sh.tok.min_tokens(size), what, at_least=True)

        def render(tok: ChatTokenizer) -> tuple[list[ToolReturn], list[int]]:
            payloads = [len(tok.encode(msgs[i]["content"])) for i in answered]
            returns = self._returns(req, msgs, answered, payloads)
            return returns, tok.prompt_ids(rendered, tools)

        returns, ids = await self.sh.offload.run(size, render)
        self._fits(len(ids), what)
        if not self.segments:
            self.segments.append(Seg(0, "", ids, list(ids)))
            n = len(ids)
            state = EpisodeState(self.spec.id, self.spec.task_id, n, n, (), "", 0, tuple(ids))
            self.place.bucket = self.place.known(self.sh.policy.on_start(state))
        else:
            reason = "tools changed" if tools != self.tools else m.describe_edit(self.history, msgs)
            self.segments.append(Seg(turn_idx, reason, ids, list(ids)))
            self._commit_returns(returns, turn_idx)
        self.tools = tools

    def _fits(self, n: int, what: str, at_least: bool = False) -> None:
        if n >= self.sh.max_context:
            tokens = f"at least {n} tokens" if at_least else f"{n} tokens"
            self._end("truncated", f"{what} ({tokens}) does not fit the context of "
                      f"{self.sh.max_context}", 400, "context_length_exceeded")  # fmt: skip

    def _answers_last(self, req: ChatRequest, i: int) -> bool:
        raw = req.messages[i]
        return str(raw.get("tool_call_id")) in self.last_calls

    def _returns(
        self, req: ChatRequest, msgs: list[dict[str, Any]], idx: list[int], payloads: list[int]
    ) -> list[ToolReturn]:
        """Tool returns reported by this request; tool latency = the time the agent took
        between the reply and this request (one figure for all of them). An `info`
        object on a tool message (like `status`, a Libra extension) goes on the record."""
        gap = max(0.0, self.sh.clock() - self.replied_at) if idx else 0.0
        out = []
        for i, payload in zip(idx, payloads, strict=True):
            text, raw = msgs[i]["content"], req.messages[i]
            info = raw.get("info")
            if info is not None and not isinstance(info, dict):
                raise m.BadMessages(f"messages[{i}]: `info` must be an object")
            if info is not None and deeper_than(info):
                raise m.BadMessages(f"messages[{i}]: `info` nests more than {MAX_DEPTH} levels")
            out.append(ToolReturn(
                tool=msgs[i]["name"],
                status=m.tool_status(raw, text),
                payload_tokens=payload,
                latency_s=gap,
                info=info or None,
            ))  # fmt: skip
        return out

    def _commit_returns(self, returns: list[ToolReturn], turn_idx: int) -> None:
        if not returns:
            return
        self.turns[-1].tool_returns.extend(returns)
        self.tool_s += returns[0].latency_s
        self.tool_states.extend(ToolState(r.tool, r.status, r.payload_tokens) for r in returns)
        seg = self.segments[-1]
        state = EpisodeState(
            self.spec.id,
            self.spec.task_id,
            len(self.segments[0].prompt_ids),
            len(seg.context),
            tuple(self.tool_states),
            self.place.bucket,
            turn_idx,
        )
        decision = self.sh.policy.on_tool_return(state)
        if isinstance(decision, Decision):
            to, reason = decision.bucket, decision.reason or "policy"
        else:
            to, reason = decision, "policy"
        self.place.move(turn_idx, self.place.known(to), reason, len(seg.context))

    def _close_turn(
        self,
        req: ChatRequest,
        msgs: list[dict[str, Any]],
        start: int,
        served: Served,
        finish: str | None,
    ) -> Reply:
        tok = self.sh.tok
        seg = self.segments[-1]
        ids = seg.response[start:]
        text = tok.decode(ids)
        closed = bool(ids) and ids[-1] in tok.eos_token_ids
        if closed and tok.eos_token and text.endswith(tok.eos_token):
            text = text[: -len(tok.eos_token)]
        full = text  # the record's answer is parsed from what the model wrote
        if not closed and finish == "stop" and req.stop and not req.include_stop_str:
            cuts = [i for s in req.stop if (i := text.find(s)) >= 0]
            text = text[: min(cuts)] if cuts else text  # OpenAI: content omits the stop
        content, calls, arguments = self._split_calls(req, text)
        reply = Reply(
            id=f"chatcmpl-{uuid.uuid4().hex[:24]}",
            content=content,
            tool_calls=calls,
            finish_reason="tool_calls" if calls else ("length" if finish == "length" else "stop"),
            prompt_tokens=len(seg.prompt_ids) + start,
            completion_tokens=len(ids),
        )
        if req.logprobs:
            reply.token_logprobs = [
                (tok.decode([t]), lp) for t, lp in zip(ids, seg.logprobs[start:], strict=True)
            ]
        self.turns.append(Turn(
            start=start, model_tokens=len(ids), tool_tokens=0, bucket=self.place.bucket,
            endpoint=served.endpoint.url, policy_version=served.version, finish_reason=finish,
            tool_calls=[ToolCall(name=c["function"]["name"], arguments=args)
                        for c, args in zip(calls, arguments, strict=True)],
        ))  # fmt: skip
        for c in calls:
            self.names[c["id"]] = c["function"]["name"]
        self.last_calls = {c["id"] for c in calls}
        self.history = [*msgs, m.canonical(reply.message(), len(msgs), self.names)]
        self.raw = req.messages
        self.closed_turn = closed
        self.last_text, self.last_finish = full, finish
        self.replied_at = self.sh.clock()
        return reply

    def _split_calls(
        self, req: ChatRequest, text: str
    ) -> tuple[str | None, list[dict[str, Any]], list[dict[str, Any]]]:
        """(content, tool calls) as vLLM's Hermes parser answers: the text before the first
        `<tool_call>` and the parsed calls; when a call does not parse, the whole text
        comes back as content with no calls (the agent sees what the model wrote)."""
        if not req.parse_tools or _CALL_OPEN not in text:
            return text, [], []
        parsed = self.sh.parser.parse(text)
        if not parsed or any(p.error for p in parsed):
            return text, [], []
        head = text[: text.find(_CALL_OPEN)]
        calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": p.name,
                    "arguments": json.dumps(p.arguments, ensure_ascii=False),  # as vLLM
                },
            }
            for p in parsed
        ]
        return (head if head.strip() else None), calls, [p.arguments for p in parsed]

    # --- the record --------------------------------------------------------------------
    def fill(self, rec: Trajectory) -> None:
        """Put the episode's tokens, turns and timings on `rec`."""
        rec.timings = Timings(queued_s=self.place.queued_s, generate_s=self.place.generate_s,
                              tool_s=self.tool_s)  # fmt: skip
        if not self.segments:
            return
        first = self.segments[0]
        rec.prompt_token_ids = first.prompt_ids
        rec.prompt_tokens = len(first.prompt_ids)
        rec.response_token_ids = first.response
        rec.loss_mask = first.mask
        rec.logprobs = first.logprobs
        rec.total_tokens = len(self.segments[-1].context)
        rec.turns = self.turns
        rec.migrations = self.place.migrations
        rec.segments = [
            Segment(turn=s.turn, reason=s.reason, prompt_token_ids=s.prompt_ids,
                    prompt_tokens=len(s.prompt_ids), response_token_ids=s.response,
                    loss_mask=s.mask, logprobs=s.logprobs)
            for s in self.segments[1:]
        ]  # fmt: skip
        rec._messages = [dict(x) for x in self.history]


__all__ = ["Session"]
