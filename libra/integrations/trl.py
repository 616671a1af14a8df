"""TRL's `GRPOTrainer` on Libra's rollouts: a `rollout_func` and a weight publisher.

    from libra.integrations.trl import LibraRollout, libra_reward

    rollout = LibraRollout("http://127.0.0.1:8700", env="arith", dataset=train_dataset)
    trainer = GRPOTrainer(model=MODEL_DIR, args=GRPOConfig(...), train_dataset=train_dataset,
                          reward_funcs=[libra_reward], rollout_func=rollout,
                          callbacks=[rollout.publisher()])

TRL hands `rollout_func` the prompts of this process's slice of the batch, each repeated
`num_generations` times in a row (its `RepeatSampler`), and the trainer. `LibraRollout`
finds each prompt's dataset row (by the prompt itself: `rollout_func` gets no other
column), submits one task per run of equal prompts to `libra serve-rollout` with that run
as its group, waits for the records, and returns one completion per prompt:

- `prompt_ids`: the episode's first prompt as Libra rendered it (the env's own prompt;
  TRL's `prompt` text only finds the row);
- `completion_ids`, `logprobs`: everything after it, every turn's reply and every tool's
  return, flattened; `logprobs` are the engine's for model tokens, 0 on the others;
- `env_mask`: 1 on tokens the model generated, 0 on tool and template tokens (TRL leaves
  them out of the loss);
- `libra_reward`: the episode's reward, which the pass-through `libra_reward` reward
  function returns; None for an episode that failed (TRL gives it no advantage).

The row is sent as it is: the service maps TRL's layout (`prompt` + `answer` / `solution`
/ `ground_truth`) onto the env's fields (`libra.rollout.layouts`). An episode whose history
the env edited (its record has `segments`) has no single completion: it is refused with
the reason, as are a prompt with no row and rows that disagree about one prompt.

TRL syncs weights only into its own vLLM; `publisher()` is a `TrainerCallback` that sends
the weights from the trainer's memory to every engine of the service when training begins
and after each optimizer step (`POST /v1/weights` with a broadcast: no file), as policy
version `global_step`, so each generation samples from the weights TRL trains (its records
carry that version).

Needs `trl` (`pip install 'libra-rl[trl]'`); the service side needs nothing of TRL.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from libra.client import Client
from libra.errors import LibraError
from libra.record import Trajectory
from libra.rollout.tasks import task_id

log = logging.getLogger("libra.integrations.trl")

REWARD_KEY = "libra_reward"
"""The extra field of `rollout_func`'s output holding each completion's reward."""
OK = ("ok", "truncated")


class RolloutError(LibraError):
    """A prompt `LibraRollout` cannot turn into one TRL completion (the reason says why)."""


@dataclass(frozen=True, slots=True)
class Completion:
    """One episode as TRL takes it: one prompt, one completion."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    env_mask: list[int]
    reward: float | None


def completion(rec: Trajectory, filler: int) -> Completion:
    """`rec` as one prompt and one completion. A failed episode keeps what it has, with
    reward None; `filler` (the EOS id) stands in for an empty prompt or completion,
    masked out. Raises `RolloutError` for a record in segments (edited history)."""
    if rec.segments:
        why = "; ".join(f"turn {s.turn}: {s.reason}" for s in rec.segments)
        raise RolloutError(
            f"episode {rec.id} (env {rec.env!r}) rewrote its history ({len(rec.segments) + 1} "
            f"segments; {why}); TRL takes one prompt and one completion per sample, so an env "
            "that edits its history cannot train under it: keep the history append-only "
            "(no compaction), or train with `libra train`, which takes segments"
        )
    reward = rec.reward if rec.status in OK else None
    prompt = list(rec.prompt_token_ids) or [filler]
    ids, logprobs, mask = list(rec.response_token_ids), list(rec.logprobs), list(rec.loss_mask)
    if len(logprobs) != len(ids) or len(mask) != len(ids):
        raise RolloutError(
            f"episode {rec.id}: {len(ids)} response tokens but {len(logprobs)} log-probs "
            f"and {len(mask)} mask entries (a record from an incompatible service?)"
        )
    if not ids:
        ids, logprobs, mask = [filler], [0.0], [0]
    return Completion(prompt, ids, logprobs, mask, reward)


def _key(prompt: Any) -> bytes:
    return orjson.dumps(prompt, option=orjson.OPT_SORT_KEYS)


def index_rows(dataset: Iterable[dict[str, Any]] | None) -> dict[bytes, dict[str, Any]]:
    """Each dataset row by its `prompt`; rows that share a prompt must be equal."""
    rows: dict[bytes, dict[str, Any]] = {}
    for i, item in enumerate(dataset or ()):
        row = dict(item)
        if "prompt" not in row:
            raise RolloutError(
                f"dataset row {i} has no 'prompt' column (columns: {sorted(row)}); TRL's "
                "GRPOTrainer reads its prompts from that column"
            )
        key = _key(row["prompt"])
        if key in rows and rows[key] != row:
            raise RolloutError(
                f"dataset rows with the prompt {row['prompt']!r:.80} differ ({rows[key]!r:.120} "
                f"vs {row!r:.120}); rollout_func sees only the prompt, so it cannot tell them "
                "apart: make prompts unique or drop the duplicates"
            )
        rows[key] = row
    return rows


def runs(prompts: list[Any]) -> list[tuple[Any, int, int]]:
    """(prompt, first position, count) for each run of equal consecutive prompts."""
    out: list[tuple[Any, int, int]] = []
    for i, p in enumerate(prompts):
        if out and out[-1][0] == p:
            prompt, start, n = out[-1]
            out[-1] = (prompt, start, n + 1)
        else:
            out.append((p, i, 1))
    return out


def libra_reward(completions: list[Any], **kwargs: Any) -> list[float | None]:
    """The pass-through reward function: each completion's episode reward (the env's),
    None for a failed episode. Give it to `GRPOTrainer(reward_funcs=[libra_reward])`."""
    rewards = kwargs.get(REWARD_KEY)
    if rewards is None:
        raise RolloutError(
            f"no {REWARD_KEY!r} in the reward inputs: libra_reward needs "
            "GRPOTrainer(rollout_func=LibraRollout(...))"
        )
    return list(rewards)


class LibraRollout:
    """`rollout_func` for TRL's `GRPOTrainer`, backed by `libra serve-rollout` at `url`.

    `env` is the name of an env the service hosts; `dataset` the trainer's dataset (each
    prompt's row is found in it; without it the task is `{"prompt": <prompt>}`);
    `sampling` overrides the per-turn sampling (default: the trainer's `temperature`,
    `top_p`, and `max_completion_length` as each turn's `max_tokens`).
    `records` holds the last call's records, for logging.
    """

    def __init__(
        self,
        url: str,
        env: str,
        dataset: Iterable[dict[str, Any]] | None = None,
        *,
        token: str | None = None,
        sampling: dict[str, Any] | None = None,
        host: str = "127.0.0.1",
    ):
        self.env = env
        self.rows = index_rows(dataset)
        self.sampling = sampling
        self.host = host
        self.client = Client(url, token=token)
        self.records: list[Trajectory] = []
        self.published: int | None = None

    def close(self) -> None:
        self.client.close()

    def _sampling(self, trainer: Any) -> dict[str, Any]:
        if self.sampling is not None:
            return dict(self.sampling)
        args = trainer.args
        out: dict[str, Any] = {"temperature": float(args.temperature)}
        if getattr(args, "top_p", None) is not None:
            out["top_p"] = float(args.top_p)
        if getattr(args, "max_completion_length", None):
            out["max_tokens"] = int(args.max_completion_length)
        return out

    def _task(self, prompt: Any) -> dict[str, Any]:
        if not self.rows:
            return {"prompt": prompt}
        row = self.rows.get(_key(prompt))
        if row is None:
            raise RolloutError(
                f"no dataset row has the prompt {prompt!r:.100}; pass the trainer's dataset "
                "as LibraRollout(..., dataset=train_dataset) (and eval_dataset's rows too)"
            )
        return row

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """One completion per prompt, in order (see the module's docstring)."""
        step = int(trainer.state.global_step)
        groups = runs(prompts)
        seen: dict[str, int] = {}
        by_size: dict[int, list[tuple[str, dict[str, Any]]]] = {}
        where: dict[str, tuple[int, int]] = {}
        for prompt, start, n in groups:
            task = dict(self._task(prompt))
            tid = task_id(task)
            seen[tid] = seen.get(tid, 0) + 1
            if seen[tid] > 1:  # the same prompt twice in one call: two tasks
                tid = f"{tid}~{seen[tid]}"
            task["id"] = tid
            by_size.setdefault(n, []).append((tid, task))
            where[tid] = (start, n)
        sampling = self._sampling(trainer)
        got: dict[str, list[Trajectory]] = {}
        self.records = []
        for size, tasks in by_size.items():
            batch = self.client.submit(self.env, [t for _, t in tasks], group_size=size,
                                       sampling=sampling, step=step)  # fmt: skip
            for rec in self.client.trajectories(batch):
                got.setdefault(rec.task_id, []).append(rec)
                self.records.append(rec)
        filler = _eos(trainer)
        out: list[Completion | None] = [None] * len(prompts)
        for tid, (start, n) in where.items():
            recs = sorted(got.get(tid, []), key=lambda r: r.id)
            if len(recs) != n:
                raise RolloutError(f"task {tid}: the service returned {len(recs)} of {n} episodes")
            for k, rec in enumerate(recs):
                out[start + k] = completion(rec, filler)
        done = [c for c in out if c is not None]
        failed = [r for r in self.records if r.status not in OK]
        if failed:
            first = failed[0]
            log.warning("%d of %d episodes failed (no advantage); first: %s: %s",
                        len(failed), len(self.records), first.status, first.error)  # fmt: skip
        return {
            "prompt_ids": [c.prompt_ids for c in done],
            "completion_ids": [c.completion_ids for c in done],
            "logprobs": [c.logprobs for c in done],
            "env_mask": [c.env_mask for c in done],
            REWARD_KEY: [c.reward for c in done],
        }

    def publish(self, model: Any, version: int) -> None:
        """Send `model`'s weights from memory to every engine of the service as `version`."""
        tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))

        def tensors() -> dict[str, Any]:
            state = {k: v.detach() for k, v in model.state_dict().items()}
            if tied:  # a tied checkpoint has no lm_head of its own
                state.pop("lm_head.weight", None)
            return state

        self.client.broadcast_weights(version, tensors, host=self.host)
        self.published = version

    def publisher(self) -> Any:
        """A `transformers.TrainerCallback` that publishes the trainer's weights when
        training begins (the service may hold another run's) and after each optimizer step."""
        from transformers import TrainerCallback

        rollout = self

        class PublishWeights(TrainerCallback):
            def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                self.on_step_end(args, state, control, **kwargs)

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                model = kwargs.get("model")
                if model is not None and state.is_world_process_zero:
                    rollout.publish(model, int(state.global_step))

        return PublishWeights()


def _eos(trainer: Any) -> int:
    tok = getattr(trainer, "processing_class", None)
    tok = getattr(tok, "tokenizer", tok)  # a processor wraps its tokenizer
    eos = getattr(tok, "eos_token_id", None)
    return int(eos) if eos is not None else 0


__all__ = ["Completion", "LibraRollout", "RolloutError", "completion", "libra_reward", "runs"]
