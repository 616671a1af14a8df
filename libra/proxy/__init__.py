"""Bring your own agent: an OpenAI-compatible proxy that makes any `openai`-SDK agent a
Libra episode.

    async def run(task, client: openai.AsyncOpenAI) -> float | dict: ...

`libra rollout --env my_agent.py:run` runs it: each episode's `client` points at its own
path on one loopback server; every chat completion is rendered with the model's chat
template, routed to a bucket, generated token-in/token-out, and recorded exactly as for
a native env (see `session.py` for the rules, docs/proxy.md for the design).

Modules: `agent` (the function as an env), `runner` (`AgentRunner`, the EpisodeRunner
twin), `server` (HTTP), `session` (one episode's tokens and turns), `messages`
(canonical messages, history edits, tool status), `protocol` (the OpenAI wire format).
"""

from libra.proxy.agent import AgentEnv, as_agent

__all__ = ["AgentEnv", "AgentRunner", "as_agent"]


def __getattr__(name: str) -> object:
    # AgentRunner pulls in aiohttp and the endpoint pool; `load_env` only needs AgentEnv.
    if name == "AgentRunner":
        from libra.proxy.runner import AgentRunner

        return AgentRunner
    raise AttributeError(name)
