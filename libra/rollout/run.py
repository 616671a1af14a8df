"""`libra rollout` as a Python API: one batch of episodes, records to a JSONL file.

summary = asyncio.run(libra.rollout.rollout(RolloutConfig(env="arith", ...)))
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from libra import registry, usercode
from libra.chat import ChatTokenizer
from libra.endpoints.pool import EndpointPool
from libra.env import Env
from libra.errors import ConfigError
from libra.proxy.agent import AgentEnv, as_agent
from libra.record import Trajectory
from libra.rollout.batch import Runner, run_episodes
from libra.rollout.config import RolloutConfig
from libra.rollout.episode import EpisodeRunner
from libra.rollout.layouts import adapt_tasks
from libra.rollout.offload import offload
from libra.rollout.serving import Serving, open_pool, resolve_model, resolve_serving
from libra.rollout.sink import JsonlSink, Progress, Stats
from libra.rollout.tasks import episode_specs, given_tasks, load_tasks, unique_ids
from libra.rollout.wire import Lesson, RawRecord
from libra.routing.base import Bucket, RoutingPolicy, StaticPolicy

log = logging.getLogger("libra.rollout")


def load_env(spec: str, options: dict[str, Any]) -> Env:
    """An env instance from a registered id, a `file.py:Class` / `pkg.mod:Class` path, or
    `verifiers:TASKSET` (a verifiers environment, `libra.integrations.verifiers`)."""
    if spec.startswith("verifiers:"):
        from libra.integrations.verifiers import load

        return load(spec, options)
    obj = registry.envs.get(spec)
    if isinstance(obj, Env):
        return check_env(obj, spec)
    if isinstance(obj, type) and issubclass(obj, Env):
        try:
            env = obj(**options)
        except TypeError as e:
            raise ConfigError(f"env {spec!r} rejected its options {options}: "
                              f"{usercode.text(e)}") from None  # fmt: skip
        except (Exception, SystemExit) as e:  # its constructor is user code
            raise ConfigError(f"env {spec!r} failed to start: {usercode.describe(e)}") from None
        return check_env(env, spec)
    # An agent function `async def run(task, client)`: runs through the OpenAI proxy.
    agent = as_agent(obj, spec, options)
    if agent is not None:
        return agent
    raise ConfigError(
        f"{spec!r} is not a libra.Env subclass nor an async agent function "
        f"`async def run(task, client)` (got {type(obj).__name__})"
    )


CLOSE_S = 60.0
"""How long `env.close` may take before the job ends without it."""


async def close_env(env: Env, limit_s: float | None = None) -> None:
    """`env.close()` as user code (`libra.usercode`, under `limit_s`): a failure or an
    overrun is logged, never raised, so the job that ran the env still ends as it
    should (a close that never returned kept `libra rollout` running after its last
    record; a plain `def close` or one that raised ended it with a traceback)."""
    limit_s = CLOSE_S if limit_s is None else limit_s
    try:
        await usercode.call(env.close, limit_s=limit_s, what="env.close")
    except usercode.LimitExceeded:
        log.warning("env.close did not return within %g s; the job ends without it", limit_s)
    except Exception as e:
        log.warning("env.close failed: %s", usercode.describe(e))


def check_env(env: Env, spec: str) -> Env:
    """`env` when its class attributes are what the runner uses, else one `ConfigError`
    naming the attribute (each was an error in every episode, a silent loss of tools, or
    a traceback when the runner started)."""
    from libra.tooling import Tool

    def bad(what: str) -> ConfigError:
        return ConfigError(f"env {spec!r}: {what}")

    tools = env.tools
    if isinstance(tools, str | bytes) or not isinstance(tools, list | tuple):
        raise bad(f"tools is a {type(tools).__name__}; give a list of @libra.tool functions")
    if wrong := [t for t in tools if not isinstance(t, Tool)]:
        raise bad(f"tools holds a {type(wrong[0]).__name__}, not a tool; decorate the "
                  "function with @libra.tool")  # fmt: skip
    names = [t.name for t in tools]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise bad(f"two tools are named {twice[0]!r}; the model calls tools by name")
    if isinstance(env.max_turns, bool) or not isinstance(env.max_turns, int) or env.max_turns < 1:
        raise bad(f"max_turns is {env.max_turns!r}; give an int >= 1")
    stop = env.stop
    if (
        isinstance(stop, str)
        or not isinstance(stop, list | tuple)
        or not all(isinstance(x, str) and x for x in stop)
    ):
        raise bad(f'stop is {stop!r}; give a tuple of strings, e.g. ("</answer>",)')
    fields = getattr(env, "task_fields", None)
    if fields is not None and (
        not isinstance(fields, tuple | list)
        or len(fields) != 2
        or not all(isinstance(f, str) and f for f in fields)
    ):
        raise bad(f'task_fields is {fields!r}; give (question, answer) field names, e.g. '
                  '("question", "answer"), or None')  # fmt: skip
    return env


@contextlib.asynccontextmanager
async def episode_runner(env: Env, **kwargs: Any) -> AsyncIterator[Runner]:
    """The runner for `env` (every job builds its runner here): an `EpisodeRunner` for a
    libra.Env; for an agent function an `AgentRunner`, whose OpenAI-compatible proxy
    serves the episodes while the block runs. `kwargs` are EpisodeRunner's, less `env`.
    The threads its episodes will use are started here, off the loop."""
    await asyncio.to_thread(_start_threads, kwargs["tokenizer"])
    if isinstance(env, AgentEnv):
        from libra.proxy.runner import AgentRunner

        async with AgentRunner(agent=env, **kwargs) as runner:
            yield runner
    else:
        yield EpisodeRunner(env=env, **kwargs)


def _start_threads(tokenizer: ChatTokenizer) -> None:
    usercode.prestart()
    offload(tokenizer).warm()


def make_policy(name: str, buckets: Sequence[Bucket], options: dict[str, Any]) -> RoutingPolicy:
    """A routing policy by name (`cmlfq`, `mlfq`, `predictor`, `static`) with the
    config's `[routing]` table (`libra.routing.RoutingConfig`)."""
    from libra.routing import make_policy as factory

    return factory(name, buckets, options)


async def finish_step(policy: RoutingPolicy, step: int) -> None:
    """End of a step (a batch): the policy learns what finished (between-steps mode) and
    saves what it learned when it was given a file (`[routing] tree_path`)."""
    end_step = getattr(policy, "end_step", None)
    if end_step is not None:
        end_step(step)
    save = getattr(policy, "save", None)
    if save is not None and getattr(getattr(policy, "config", None), "tree_path", None):
        await asyncio.to_thread(save)


def _same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


async def rollout(
    config: RolloutConfig,
    *,
    tasks: list[dict[str, Any]] | None = None,
    on_record: Callable[[Trajectory], None] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run one batch as configured; return the summary (also what `--json` prints).
    `on_record` is a plain function, called with each record as it is written."""
    if on_record is not None and inspect.iscoroutinefunction(on_record):
        raise ConfigError("on_record is an async function, which would never run; pass a "
                          "plain function (start a task from it if it must await)")  # fmt: skip
    serving = resolve_serving(config.model, config.limits.max_context, config.buckets)
    env = load_env(config.env, config.env_options)
    if tasks is None:
        tasks_path = config.tasks or env.default_tasks()
        if tasks_path is None:
            raise ConfigError(f"env {config.env!r} ships no tasks; pass --tasks FILE")
        tasks = load_tasks(tasks_path, config.num_tasks or 0)
        tasks = adapt_tasks(tasks, env.task_fields, env=config.env, source=str(tasks_path))
        unique_ids(tasks, str(tasks_path))
        if _same_file(config.out, tasks_path):
            raise ConfigError(f"out {config.out!r} is the tasks file; records are appended "
                              "to out: pass another file")  # fmt: skip
    else:
        tasks = given_tasks(tasks, "rollout(tasks=...)")
        tasks = adapt_tasks(tasks, env.task_fields, env=config.env, source="rollout(tasks=...)")
        unique_ids(tasks, "rollout(tasks=...)")
    batch_id = config.batch_id or uuid.uuid4().hex[:12]
    specs = list(episode_specs(tasks, config.group_size, batch_id, config.step))
    policy = make_policy(config.policy, serving.buckets, config.routing)
    stats = Stats(len(specs))
    sink = JsonlSink(config.out)
    bar = Progress(stats) if progress else None

    def emit(record: Trajectory | RawRecord) -> None:
        record = sink(record)
        stats.add(record)
        if on_record is not None:  # a worker's record is parsed only for a caller's hook
            on_record(record if isinstance(record, Trajectory) else Trajectory.from_json(
                record.to_json()))  # fmt: skip
        if bar is not None:
            bar(record)

    try:
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(close_env, env)  # last: after engines and pool stop
            pool = await stack.enter_async_context(
                open_pool(serving, config.endpoint, cluster=config.cluster, launch=config.launch)
            )
            if config.workers > 1:
                runner = await _worker_runner(stack, config, serving, pool, batch_id, policy)
            else:
                runner = await stack.enter_async_context(
                    episode_runner(
                        env,
                        env_name=config.env,
                        tokenizer=serving.tokenizer,
                        pool=pool,
                        policy=policy,
                        sampling=config.sampling,
                        limits=config.limits,
                        max_context=serving.max_context,
                    )
                )
            stats.t0 = stats.clock()
            await run_episodes(runner, specs, concurrency=config.concurrency, emit=emit)
            await finish_step(policy, config.step)
    finally:
        sink.close()
    summary = stats.summary()
    summary.update(batch_id=batch_id, out=str(config.out), env=config.env, policy=config.policy)
    return summary


async def _worker_runner(
    stack: contextlib.AsyncExitStack,
    config: RolloutConfig,
    serving: Serving,
    pool: EndpointPool,
    batch_id: str,
    policy: RoutingPolicy,
) -> Runner:
    """`config.workers` rollout workers over `pool`'s endpoints, and the batch's runner
    on them (its records are `RawRecord`s: the sink writes them as they came). `policy`
    learns from every record's lesson, as each worker's does (`finish_step` saves it to
    `tree_path`)."""
    from libra.rollout.worker import HostedEnv, WorkerInit
    from libra.rollout.workers import BatchInfo, WorkerPool, split_limits, worker_buckets

    def init() -> WorkerInit:
        return WorkerInit(
            model=str(serving.model_dir),
            max_context=serving.max_context,
            buckets=worker_buckets(pool),
            endpoint=split_limits(config.endpoint, config.workers),
            limits=config.limits,
            envs=[HostedEnv(name=config.env, spec=config.env, options=config.env_options)],
            policy=config.policy,
            routing=config.routing,
            versions={e.url: e.version for e in pool.endpoints()},
            paused=[e.url for e in pool.endpoints() if not e.admitting],
        )

    def learn(env: str, lesson: Lesson) -> None:
        policy.on_finish(lesson)

    workers = await stack.enter_async_context(WorkerPool(config.workers, init, learn))
    info = BatchInfo(batch_id, config.env, config.sampling.model_dump(mode="json"))
    return workers.runner(info, StaticPolicy(serving.buckets))


GC_THRESHOLDS = (700, 10, 1000)
"""The garbage collector's generation thresholds in a rollout process (`run_sync`).

A full collection walks every tracked object and stops the event loop meanwhile: at
10,000 episodes in flight that is ~400k objects and 100-400 ms. With Python's default
(700, 10, 10) one runs every 10 middle-generation passes once the old generation grew
by a quarter: every 3-4 s at ~1,000 turns/s (10 in a 10k x 4 bench run). 1000 instead
of 10 allows one per 7M net allocations, minutes apart at full load. What waits for it is
cyclic garbage that became garbage after it grew old; Libra's own episode state makes
next to none (those bench runs found none in any full pass). The young generations
keep their defaults: their passes are short (under ~25 ms at 10k in flight)."""


def run_sync(coro: Any) -> Any:
    """Run a coroutine on uvloop when it is installed (the CLI's entry to asyncio).

    Objects alive at start-up (modules, tokenizer, config) are moved out of the garbage
    collector's view (`gc.freeze`): with thousands of episodes in flight a full
    collection otherwise rescans them all and stalls the event loop for longer. Full
    collections are made rare (`GC_THRESHOLDS`): this is a long-lived service process.

    Async user code that ignored its cancellation (`libra.usercode.stuck_tasks`) is not
    waited for at the end (asyncio's own close waits for every task: for ever); the
    loop closes without it, and `libra.cli.main` exits without waiting for user code
    still running in threads."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        factory = None
    runner = asyncio.Runner(loop_factory=factory)
    try:
        return runner.run(coro)
    finally:
        loop = runner.get_loop()
        if usercode.stuck_tasks(loop):
            _close_without(loop, usercode.stuck_tasks(loop))
        else:
            runner.close()


def _close_without(loop: asyncio.AbstractEventLoop, stuck: set[asyncio.Future[Any]]) -> None:
    """Close `loop` as `asyncio.Runner.close` does, except that the `stuck` tasks are
    not waited for (they are destroyed pending)."""
    log.warning("%d calls of async user code ignored their cancellation; closing without "
                "them", len(stuck))  # fmt: skip
    try:
        others = [t for t in asyncio.all_tasks(loop) if t not in stuck]
        for t in others:
            t.cancel()
        if others:
            loop.run_until_complete(asyncio.wait(others, timeout=usercode.GRACE_S))
    finally:
        asyncio.set_event_loop(None)
        loop.close()


__all__ = [
    "GC_THRESHOLDS",
    "check_env",
    "close_env",
    "episode_runner",
    "finish_step",
    "load_env",
    "make_policy",
    "resolve_model",
    "rollout",
    "run_sync",
]
