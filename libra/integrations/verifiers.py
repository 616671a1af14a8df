"""verifiers environments run by Libra: `--env verifiers:TASKSET`.

    libra rollout --env verifiers:my_taskset --endpoint tp1=http://127.0.0.1:8000

verifiers 0.4 (PyPI `verifiers`; its stack lives in `verifiers.v1`) splits an environment
into a *taskset* (a package exporting a `vf.Taskset` subclass via `__all__`, whose tasks
carry `@vf.reward` / `@vf.metric` methods and MCP `vf.Toolset`s), an `Env` playing it
(`SingleAgentEnv` unless the taskset names another) and a *harness*, the agent program
that talks to the model through verifiers' interception server. `TASKSET` is the id
verifiers resolves (`verifiers.v1.load_environment`): an importable module or package.

Each Libra episode runs one verifiers episode (`Env.run_episode`) whose model is Libra's
per-episode OpenAI-compatible proxy, so the record is a native one: token ids, log-probs
and loss mask of every turn, routing, migrations. The reward is the episode's (the sum of
its traces' weighted `@reward`s); each reward and metric is kept in `reward_info`. An
episode verifiers reports as failed (a harness, tool or scoring error) is recorded as
`error` with verifiers' message.

Options (`env_options`, or `[[envs]] options` in a service config):

- `harness` (default `"null"`): the agent program; `null` is verifiers' chat loop, which
  calls the task's MCP tools and runs no model-written code. Harnesses that execute
  code (`bash`, ...) need a container runtime.
- `runtime` (default `"subprocess"`): where the harness runs; a table is passed as
  verifiers' runtime config (`{type = "docker", ...}`).
- `config`: more of verifiers' env config, merged over the above (its `EnvConfig` keys).

Tasks come from the taskset: `default_tasks()` lists them as `{"id", "prompt"}` rows, and
an episode's task is looked up by `id` in the taskset. A task is never built from the
fields a client sends (those could name container images, skill folders or network
rules); an unknown id is the episode's error. An infinite taskset is refused.

Needs `pip install 'libra-rl[verifiers]'` (which takes `openai` < 3, as verifiers does, and
`uv`). The harness and MCP tool programs are verifiers' own: it prepares them with `uv`
(the extra's, put on PATH when missing there), their dependencies come from PyPI on first
use (then from uv's cache). A tool server is started as `python -m MODULE` with this
interpreter: a taskset module that declares a `vf.Toolset` ends with
`if __name__ == "__main__": MyToolset.run()`.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import orjson

from libra.env import Env
from libra.errors import ConfigError, LibraError
from libra.paths import user_cache
from libra.proxy.agent import AgentEnv
from libra.proxy.server import MODEL_NAME

PREFIX = "verifiers:"
_keys = itertools.count()


class EpisodeFailed(LibraError):
    """verifiers reported the episode as failed (its message says why)."""


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ConfigError(
            f"--env verifiers:... needs the verifiers package ({e}): "
            "pip install 'libra-rl[verifiers]'"
        ) from None
    return vf


def _child_env() -> None:
    """What verifiers' programs inherit from this process. It prepares them with `uv`
    found on PATH; the one the `verifiers` extra installs sits beside this interpreter,
    which a venv used without activation does not put on PATH. It starts a tool server
    as `python -m MODULE` in a working folder of its own, where a relative PYTHONPATH
    entry (`PYTHONPATH=examples`) would point nowhere: entries are made absolute."""
    here = Path(sys.executable).parent
    if shutil.which("uv") is None and (here / "uv").is_file():
        os.environ["PATH"] = f"{here}{os.pathsep}{os.environ.get('PATH', '')}"
    if path := os.environ.get("PYTHONPATH"):
        parts = [str(Path(p).resolve()) if p else p for p in path.split(os.pathsep)]
        os.environ["PYTHONPATH"] = os.pathsep.join(parts)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class VerifiersEnv(AgentEnv):
    """One verifiers environment (taskset + env + harness) as a Libra agent env."""

    def __init__(
        self,
        taskset: str,
        *,
        harness: str = "null",
        runtime: str | dict[str, Any] = "subprocess",
        config: dict[str, Any] | None = None,
    ):
        Env.__init__(self, harness=harness, runtime=runtime, config=config)
        self.fn = self._episode
        self.name = PREFIX + taskset
        self.taskset_id = taskset
        vf = _vf()
        _child_env()
        rt = {"type": runtime} if isinstance(runtime, str) else dict(runtime)
        doc = {"taskset": {"id": taskset}, "agent": {"harness": {"id": harness}, "runtime": rt}}
        try:
            self.vf_config = vf.resolve_env_config(_merge(doc, config or {}))
            self.vf_env = vf.load_environment(self.vf_config)
        except Exception as e:  # verifiers' loaders raise many kinds, each with a reason
            raise ConfigError(f"verifiers env {taskset!r}: {type(e).__name__}: {e}") from None
        if not self.vf_env.taskset.bounded:
            raise ConfigError(
                f"verifiers taskset {taskset!r} is infinite; Libra runs the tasks it lists "
                "(bound it in the taskset, e.g. by a count in its config)"
            )
        self._tasks: dict[str, Any] | None = None
        self._key_var = f"LIBRA_VERIFIERS_KEY_{os.getpid()}_{next(_keys)}"
        self._serving: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[None] | None = None
        self._stop: asyncio.Event | None = None

    # --- tasks ------------------------------------------------------------------
    def tasks(self) -> dict[str, Any]:
        """The taskset's tasks by Libra task id (the task's own `id`, else its key)."""
        if self._tasks is None:
            tasks: dict[str, Any] = {}
            for task in self.vf_env.taskset:
                tid = str(task.data.id) if task.data.id is not None else task.key[:16]
                if tid in tasks:
                    raise ConfigError(
                        f"verifiers taskset {self.taskset_id!r}: two tasks with id {tid!r}"
                    )
                tasks[tid] = task
            self._tasks = tasks
        return self._tasks

    def rows(self) -> list[dict[str, Any]]:
        return [{"id": tid, "prompt": t.data.prompt_text} for tid, t in self.tasks().items()]

    def default_tasks(self) -> Path:  # type: ignore[override]
        """The taskset's tasks as a JSONL file (content-addressed in the user's cache
        folder: in the shared temp folder another user could make it first)."""
        data = b"".join(orjson.dumps(r) + b"\n" for r in self.rows())
        digest = hashlib.sha1(data).hexdigest()[:12]
        folder = user_cache("verifiers-tasks")
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.taskset_id.replace('/', '_')}-{digest}.jsonl"
        if not path.exists():
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
        return path

    async def _task(self, task: dict[str, Any]) -> Any:
        # The first call reads the whole taskset: in a thread, off the loop.
        tasks = self._tasks if self._tasks is not None else await asyncio.to_thread(self.tasks)
        tid = task.get("id")
        found = tasks.get(str(tid)) if tid is not None else None
        if found is None:
            raise EpisodeFailed(
                f"task id {tid!r} is not a task of verifiers taskset {self.taskset_id!r} "
                "(its tasks are listed by `default_tasks()`; a task is chosen by id, never "
                "built from the request)"
            )
        return found

    # --- serving ----------------------------------------------------------------
    async def _hold(self) -> None:
        """verifiers' serving resources (interception server, shared tools) for the run,
        entered and left in this one task."""
        assert self._ready is not None and self._stop is not None
        try:
            async with self.vf_env.serving():
                self._ready.set_result(None)
                await self._stop.wait()
        except BaseException as e:
            if not self._ready.done():
                self._ready.set_exception(e)
            raise

    async def _up(self) -> None:
        # A serving task that ended (it failed to start: each waiting episode got its
        # error) is started again by the next episode rather than failing every one.
        if self._serving is None or self._serving.done():
            if self._serving is not None and not self._serving.cancelled():
                self._serving.exception()  # retrieved: the episodes reported it
            self._ready = asyncio.get_running_loop().create_future()
            self._stop = asyncio.Event()
            self._serving = asyncio.create_task(self._hold(), name=f"{self.name} serving")
        await asyncio.shield(self._ready)  # type: ignore[arg-type]

    async def close(self) -> None:
        if self._serving is not None and self._stop is not None:
            self._stop.set()
            try:
                await self._serving
            except Exception:  # its failure was each episode's already
                pass
            self._serving = None

    # --- episodes ---------------------------------------------------------------
    async def _episode(self, task: dict[str, Any], client: Any) -> dict[str, Any]:
        vf = _vf()
        vf_task = await self._task(task)
        await self._up()
        os.environ[self._key_var] = str(client.api_key)
        ctx = vf.ModelContext(
            model=MODEL_NAME,
            client=vf.EvalClientConfig(base_url=str(client.base_url), api_key_var=self._key_var),
        )
        episode = await self.vf_env.run_episode(vf_task, ctx)
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        if errors:
            raise EpisodeFailed(f"verifiers: {errors[0].type}: {errors[0].message}")
        traces = episode.traces
        rewards = {k: r.value for t in traces for k, r in t.rewards.items() if r is not None}
        metrics = {k: v for t in episode.traces for k, v in t.metrics.items()}
        return {
            "reward": sum(t.reward for t in episode.traces),
            "rewards": rewards,
            "metrics": metrics,
        }

    async def __call__(self, task: dict[str, Any], client: Any) -> Any:
        return await self._episode(task, client)


def load(spec: str, options: dict[str, Any]) -> VerifiersEnv:
    """`verifiers:TASKSET` with its options."""
    taskset = spec[len(PREFIX) :]
    if not taskset:
        raise ConfigError("--env verifiers: needs a taskset id: verifiers:my_taskset")
    known = {"harness", "runtime", "config"}
    if unknown := sorted(set(options) - known):
        raise ConfigError(
            f"env {spec!r}: unknown option(s) {unknown}; a verifiers env takes "
            f"{sorted(known)} (more of verifiers' env config goes under `config`)"
        )
    return VerifiersEnv(taskset, **options)


__all__ = ["PREFIX", "EpisodeFailed", "VerifiersEnv", "load"]
