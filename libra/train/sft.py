"""The supervised warm start: fit the model to expert demonstrations before GRPO.

Cross-entropy on the model tokens of each demonstration (loss mask 1; tool responses and
template tokens carry no loss), AdamW with a linear warm-up, gradient clipping at 1.

Agentic prompts share a long prefix (system prompt + tool schemas: 336 of ~410 tokens on
`arith`), so each batch runs that prefix once and the batch's suffixes attend to its
cached keys and values; gradients flow through the cache into the prefix. The loss and
gradients equal the plain padded batch's (tested to 1e-5), at a quarter of the compute.
Logits are computed only where a loss token is predicted.

Stopping: after `steps` updates, or earlier once the held-out demonstrations' mean
sequence probability at temperature 1 (about the chance of sampling one whole, correct
demonstration) reaches `target`: GRPO then starts from a policy that is right some of the
time, which is where a group's rewards differ and its advantages carry signal.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from libra.record import Trajectory
from libra.trainer.model import load_model, tied_keys, write_folder

WARMUP = 20
EVAL_EVERY = 20


@dataclass(slots=True)
class SFTProgress:
    step: int
    steps: int
    loss: float
    seq_prob: float | None
    """Held-out mean sequence probability (last evaluation)."""
    elapsed_s: float


@dataclass(slots=True)
class SFTResult:
    path: str
    steps: int
    loss: float
    seq_prob: float
    wall_s: float
    cpu_s: float
    stopped: str
    """`target` (reached it) or `steps` (ran them all)."""


def _common_prefix(seqs: Sequence[Sequence[int]], limit: int) -> int:
    n = 0
    first = seqs[0]
    while n < limit and all(len(s) > n + 1 and s[n] == first[n] for s in seqs):
        n += 1
    return n


def sequence_logprobs(model: Any, demos: Sequence[Trajectory]) -> tuple[torch.Tensor, list[int]]:
    """Log-probs of every loss token of `demos` (concatenated, demo by demo) and the
    count per demo. The shared prompt prefix runs once."""
    seqs = [[*d.prompt_token_ids, *d.response_token_ids] for d in demos]
    p = _common_prefix(seqs, min(len(d.prompt_token_ids) for d in demos))
    b = len(seqs)
    out = model(input_ids=torch.tensor([seqs[0][:p]]), use_cache=True)
    cache = out.cache
    cache.batch_repeat_interleave(b)
    width = max(len(s) - p for s in seqs)
    ids = torch.zeros(b, width, dtype=torch.long)
    att = torch.ones(b, p + width, dtype=torch.long)
    sel = torch.zeros(b, width, dtype=torch.bool)  # loss on the token at this position
    for i, (s, d) in enumerate(zip(seqs, demos, strict=True)):
        n = len(s) - p
        ids[i, :n] = torch.tensor(s[p:])
        att[i, p + n :] = 0
        start = len(d.prompt_token_ids) - p  # >= 1: the prefix ends inside the prompt
        sel[i, start : start + len(d.loss_mask)] = torch.tensor(d.loss_mask, dtype=torch.bool)
    pos = torch.arange(p, p + width).expand(b, width)
    hidden = model.model(
        input_ids=ids, attention_mask=att, cache=cache, position_ids=pos, use_cache=True
    ).last_hidden_state
    want = sel[:, 1:]  # the token at j is predicted by position j - 1
    logits = model.lm_head(hidden[:, :-1][want]).float()
    target = ids[:, 1:][want]
    lp = torch.log_softmax(logits, -1).gather(-1, target[:, None]).squeeze(-1)
    return lp, want.sum(1).tolist()


def seq_prob(model: Any, demos: Sequence[Trajectory]) -> float:
    """Mean probability, at temperature 1, of generating each demonstration's model tokens."""
    with torch.no_grad():
        lp, counts = sequence_logprobs(model, demos)
    return sum(math.exp(float(x.sum())) for x in torch.split(lp, counts)) / len(demos)


def run_sft(
    model_dir: str | Path,
    demos: Sequence[Trajectory],
    out: str | Path,
    *,
    steps: int,
    batch: int,
    lr: float,
    target: float | None,
    seed: int,
    held_out: int = 32,
    on_progress: Callable[[SFTProgress], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> SFTResult:
    """Fit `model_dir` to `demos`; write the result as an HF folder at `out`."""
    t0, c0 = time.perf_counter(), time.process_time()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pool = list(demos)
    rng.shuffle(pool)
    held, train = pool[:held_out], pool[held_out:] or pool
    model = load_model(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
    loss_v, prob, stopped, done = math.nan, 0.0, "steps", 0
    for step in range(steps):
        if should_stop():
            raise KeyboardInterrupt
        lp, _ = sequence_logprobs(model, [rng.choice(train) for _ in range(batch)])
        loss = -lp.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        done, loss_v = step + 1, loss.item()
        evaluate = done % EVAL_EVERY == 0 or done == steps
        if evaluate:
            prob = seq_prob(model, held)
        if on_progress is not None:
            on_progress(SFTProgress(done, steps, loss_v, prob, time.perf_counter() - t0))
        if evaluate and target is not None and prob >= target:
            stopped = "target"
            break
    path = write_folder(dict(model.state_dict()), model_dir, out, tied_keys(model))
    return SFTResult(
        path=str(path),
        steps=done,
        loss=loss_v,
        seq_prob=prob,
        wall_s=time.perf_counter() - t0,
        cpu_s=time.process_time() - c0,
        stopped=stopped,
    )


__all__ = ["SFTProgress", "SFTResult", "run_sft", "seq_prob", "sequence_logprobs"]
