"""`AgentRunner`: runs agent functions as episodes; the same interface as `EpisodeRunner`.

    async with AgentRunner(agent=env, env_name=..., tokenizer=..., pool=..., policy=...,
                           sampling=..., limits=..., max_context=...) as runner:
        record = await runner.run(spec)          # or run_episodes(runner, specs, ...)

Each episode gets its own `openai.AsyncOpenAI` client whose base URL is the episode's
path on the runner's proxy server; the agent runs under `limits.episode_timeout_s`, and
its turns are recorded by a `Session`. The record has the fields and layout of a native
env's record (see `session.py`); the reward is what the function returns.

Status, first that applies: what ended the episode inside the proxy (`truncated` when
the context filled or `max_turns` was reached, `timeout` for a turn, `error` for an
endpoint); `error` when the agent raised (`agent raised ValueError: ...`); `timeout` when
the episode ran out of time; `error` when it never called the model; `truncated` when
its last model turn hit `max_tokens`; else `ok`. The batch goes on in every case.

Each episode's client sends its requests to the proxy in process (an httpx transport
that calls the server's `dispatch`): no loopback HTTP on either side, and no TLS context
per client — a default `AsyncOpenAI()` builds one, 51–129 ms of CPU on the reference
machine, against well under a millisecond for a client on the shared transport
(`libra bench proxy`, `client_build`).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from collections.abc import Callable
from typing import Any

from libra import usercode
from libra.chat import ChatTokenizer
from libra.endpoints.config import SamplingConfig
from libra.endpoints.pool import EndpointPool
from libra.env import overrides
from libra.proxy.agent import AgentEnv
from libra.proxy.server import ProxyServer, in_process_transport
from libra.proxy.session import Session
from libra.proxy.turns import Shared
from libra.record import Trajectory
from libra.rollout.config import LimitsConfig
from libra.rollout.episode import EpisodeSpec
from libra.rollout.inputs import own_task
from libra.rollout.offload import offload
from libra.rollout.reward import BadReward, as_reward
from libra.routing.base import RoutingPolicy
from libra.toolcalls import ToolCallParser, parser_for

log = logging.getLogger("libra.proxy")
_NOTHING = object()


def _httpx() -> Any:
    """The HTTP library the installed `openai` SDK is built on (httpx2 from openai 3, httpx
    before; both may be installed, so ask the SDK)."""
    client = importlib.import_module("openai._base_client")
    return getattr(client, "httpx2", None) or client.httpx


class AgentRunner:
    """Runs episodes of one agent function against one endpoint pool; shared by a batch."""

    def __init__(
        self,
        *,
        agent: AgentEnv,
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
        self.env = self.agent = agent
        self._own_parse = overrides(agent, "parse_answer")
        self.env_name = env_name
        self.policy = policy
        self.limits = limits
        self.clock = clock
        self.shared = Shared(
            tok=tokenizer,
            pool=pool,
            policy=policy,
            sampling=sampling,
            limits=limits,
            max_context=min(max_context, max(b.bound for b in pool.buckets)),
            parser=parser
            or parser_for(getattr(agent, "tool_parser", "auto"), tokenizer.chat_template),
            cpu=asyncio.Semaphore(cpu_slots),
            clock=clock,
            offload=offload(tokenizer),
        )
        self.server = ProxyServer()
        self._transport: Any = None

    async def __aenter__(self) -> AgentRunner:
        # In a thread: importing the SDK, and what its client imports on first use, takes
        # ~0.5 s of CPU, which on the loop would stall every episode once. Fails here,
        # not in every episode, when it is missing.
        await asyncio.to_thread(_warm_openai)
        await self.server.__aenter__()
        self._transport = in_process_transport(_httpx(), self.server)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._transport = None
        await self.server.__aexit__(*exc)

    def client(self, base_url: str) -> Any:
        """An `openai.AsyncOpenAI` for one episode. Its requests go to the proxy in
        process (`base_url` is the real server's, for agents that pass it on to another
        HTTP client); no SDK retries (a failed turn is the episode's data, not something
        to resend); bounded by the episode's time."""
        import openai

        timeout = self.limits.episode_timeout_s
        http = _httpx().AsyncClient(transport=self._transport, trust_env=False, timeout=timeout)
        return openai.AsyncOpenAI(base_url=base_url, api_key=self.server.token, max_retries=0,
                                  timeout=timeout, http_client=http)  # fmt: skip

    async def run(
        self,
        spec: EpisodeSpec,
        *,
        admitted_after_s: float = 0.0,
        on_abort: Callable[[Trajectory], None] | None = None,
    ) -> Trajectory:
        """Run one episode to its record (never raises for episode failures). When
        cancelled, the partial episode goes to `on_abort` as `aborted` and the
        cancellation propagates."""
        if self._transport is None:
            raise RuntimeError("AgentRunner.run outside `async with AgentRunner(...)`")
        t0 = self.clock()
        session = Session(spec, self.shared)
        key, base_url = self.server.open(spec.id, session)
        client = self.client(base_url)
        out: Any = _NOTHING
        failure: tuple[str, str] | None = None
        expired = False
        try:
            # In a task of its own: the episode's limit holds even for an agent that
            # swallows cancellation.
            task = await own_task(spec.task, self.shared.offload)
            out = await usercode.call(self.agent, task, client,
                                      limit_s=self.limits.episode_timeout_s,
                                      what=f"agent {self.env_name}")  # fmt: skip
        except usercode.LimitExceeded:
            expired = True
        except TimeoutError as e:
            failure = ("error", f"agent raised TimeoutError: {e}")
        except asyncio.CancelledError:
            self.server.close(key)
            # no user code while cancelled: an agent's own parser gives no answer here
            answer = None if self._own_parse else self.agent.parse_answer(session.last_text)
            record = self._record(spec, session, ("aborted", "cancelled"), _NOTHING, answer)
            self._stamp(record, t0, admitted_after_s)
            if on_abort is not None:
                on_abort(record)
            raise
        except Exception as e:  # the agent's bug is the episode's data
            log.debug("agent episode %s failed", spec.id, exc_info=True)
            failure = ("error", f"agent raised {usercode.describe(e)}")
        finally:
            self.server.close(key)
            await client.close()
        status = self._status(session, failure, expired)
        answer, status = await self._answer(session.last_text, status)
        record = self._record(spec, session, status, out, answer)
        self._stamp(record, t0, admitted_after_s)
        return record

    def _status(
        self, session: Session, failure: tuple[str, str] | None, expired: bool
    ) -> tuple[str, str | None]:
        if session.ended is not None:
            return session.ended
        if failure is not None:
            return failure
        if expired:
            return "timeout", f"episode exceeded {self.limits.episode_timeout_s:g} s"
        if not session.turns:
            return "error", "the agent returned without calling the model through its client"
        if session.last_finish == "length":
            return "truncated", "the last model turn hit max_tokens"
        return "ok", None

    async def _answer(
        self, text: str, status: tuple[str, str | None]
    ) -> tuple[str | None, tuple[str, str | None]]:
        """The answer in the agent's last text, and the status with it. Libra's parser runs
        here (linear in the text); an AgentEnv subclass's own `parse_answer` is user code,
        so it runs in a worker thread under the turn's limit, and its failure ends an
        episode that was `ok` or `truncated` as `error`."""
        if not self._own_parse:
            return self.agent.parse_answer(text), status
        try:
            answer = await usercode.call(self.agent.parse_answer, text,
                                         limit_s=self.limits.turn_timeout_s,
                                         what=f"{self.env_name}.parse_answer")  # fmt: skip
            if answer is not None and not isinstance(answer, str):
                raise TypeError(f"it returned a {type(answer).__name__}; return the answer's "
                                "text or None")  # fmt: skip
        except Exception as e:
            failed = isinstance(e, usercode.LimitExceeded)
            why = str(e) if failed else f"parse_answer raised {usercode.describe(e)}"
            return None, (("error", why) if status[0] in ("ok", "truncated") else status)
        return answer, status

    def _record(
        self,
        spec: EpisodeSpec,
        session: Session,
        status: tuple[str, str | None],
        out: Any,
        answer: str | None,
    ) -> Trajectory:
        rec = Trajectory(id=spec.id, batch_id=spec.batch_id, task_id=spec.task_id,
                         group_id=spec.group_id, env=self.env_name, step=spec.step,
                         status=status[0], error=status[1])  # fmt: skip
        session.fill(rec)
        rec.answer = answer
        if out is not _NOTHING and rec.status in ("ok", "truncated"):
            try:
                rec.reward, rec.reward_info, answer = _as_reward(out)
            except BadReward as e:
                rec.status, rec.error = "error", f"agent's reward: {e}"
            except (TypeError, ValueError, KeyError) as e:
                rec.status, rec.error = "error", f"agent returned {out!r:.80}: {e}"
            else:
                rec.answer = answer if answer is not _NOTHING else rec.answer
        return rec

    def _stamp(self, record: Trajectory, t0: float, admitted_after_s: float) -> None:
        record.timings.queued_s += admitted_after_s
        record.timings.total_s = self.clock() - t0


def _warm_openai() -> None:
    """Import the `openai` SDK and the modules its chat client loads lazily."""
    import openai

    client = openai.AsyncOpenAI(api_key="warm-up", base_url="http://127.0.0.1:9/v1",
                                http_client=_httpx().AsyncClient(trust_env=False))  # fmt: skip
    _ = client.chat.completions.create


def _as_reward(out: Any) -> tuple[float, dict[str, Any] | None, Any]:
    """(reward, info, answer) from a float, `(float, info)` or `{"reward": ..., ...}`;
    the reward must be a finite number (`libra.rollout.reward.as_reward`)."""
    if isinstance(out, dict):
        info = dict(out)
        if "reward" not in info:
            raise KeyError("a returned dict needs a 'reward' key")
        answer = info.pop("answer", _NOTHING)
        if answer is not _NOTHING and answer is not None:
            answer = str(answer)
        return (*as_reward(info), answer)
    if out is None or isinstance(out, str):
        raise TypeError("return a float reward or a dict with 'reward'")
    return (*as_reward(out), _NOTHING)


__all__ = ["AgentRunner"]
