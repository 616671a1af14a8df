"""The supervised warm start: fit the model to expert demonstrations before GRPO.

Cross-entropy on the model tokens of each demonstration (loss mask 1; tool responses and
template tokens carry no loss), AdamW with a linear warm-up and a cosine decay to 5% of
the peak rate at `steps`, gradient clipping at 1. (Measured on the CPU default's tiny
model, 600 steps: at a constant rate the held-out P(demo) ended at 0.21 / 0.02 for made
models of seeds 0 / 1, decayed at 0.43 / 0.59; docs/train.md.)

Agentic prompts share a long prefix (system prompt + tool schemas: 336 of ~410 tokens on
`arith`), so each batch runs that prefix once and the batch's suffixes attend to its
cached keys and values; gradients flow through the cache into the prefix. The loss and
gradients equal the plain padded batch's (tested to 1e-5), at a quarter of the compute.
Logits are computed only where a loss token is predicted.

Stopping: after `steps` updates, or earlier once the held-out demonstrations' mean
sequence probability at temperature 1 (about the chance of sampling one whole, correct
demonstration) reaches `target`: GRPO then starts from a policy that is right some of the
time, which is where a group's rewards differ and its advantages carry signal.

Where it runs: `warm_start` runs `run_sft` in one spawned trainer process (set up like a
rank: `libra.trainer.device`), so the driver never builds a model or imports torch for
it; progress comes back over a pipe and the result is the folder written.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import random
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from libra.errors import LibraError, TrainerError
from libra.record import Trajectory
from libra.trainer.config import TrainerConfig
from libra.trainer.device import Device, init_process
from libra.trainer.model import load_model, tied_keys, write_folder

log = logging.getLogger("libra.trainer")

WARMUP = 20
FLOOR = 0.05
"""The last step's learning rate, as a fraction of `lr`."""
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
    pid: int = 0
    """The process that trained (`warm_start`: its own process, not the caller's)."""


def lr_factor(step: int, steps: int) -> float:
    """The rate at `step` of `steps`, as a fraction of the peak: linear warm-up over
    `WARMUP` steps, then a cosine decay to `FLOOR` at `steps`."""
    warm = min(1.0, (step + 1) / WARMUP)
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, step / max(1, steps))))
    return warm * (FLOOR + (1.0 - FLOOR) * cos)


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
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps))
    loss_v, prob, stopped, done = math.nan, 0.0, "steps", 0
    for step in range(steps):
        if should_stop():
            raise KeyboardInterrupt
        lp, _ = sequence_logprobs(model, [rng.choice(train) for _ in range(batch)])
        loss = -lp.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if torch.isfinite(norm):  # a NaN or an infinity would spread to every weight
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
        pid=os.getpid(),
    )


STOP_GRACE_S = 30.0
"""After `should_stop`, how long the warm start may take to finish its step and exit
before it is killed."""


@dataclass(frozen=True, slots=True)
class _Job:
    """What the warm start process gets: `run_sft`'s arguments and its device."""

    model_dir: str
    demos: list[Trajectory]
    out: str
    steps: int
    batch: int
    lr: float
    target: float | None
    seed: int
    device: Device
    parent: int
    """The caller's pid: the process dies with it."""


def warm_start(
    model_dir: str | Path,
    demos: Sequence[Trajectory],
    out: str | Path,
    *,
    steps: int,
    batch: int,
    lr: float,
    target: float | None,
    seed: int,
    on_progress: Callable[[SFTProgress], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    device: Device | None = None,
) -> SFTResult:
    """`run_sft` in a spawned trainer process; blocks until it is done.

    `on_progress` runs in the caller's thread, once per step. `should_stop` is checked
    between messages: once true, the process is asked to stop after its step (killed if
    it takes longer than `STOP_GRACE_S`), nothing is written, and `KeyboardInterrupt` is
    raised. A failure in the process is raised here (a `LibraError` as itself, anything
    else as `TrainerError`). The process never outlives this call, nor its caller.
    `device`: what a trainer config for `model_dir` resolves to, unless given."""
    job = _Job(
        model_dir=str(model_dir), demos=list(demos), out=str(out), steps=steps, batch=batch,
        lr=lr, target=target, seed=seed, parent=os.getpid(),
        device=device or Device.resolve(TrainerConfig(model=str(model_dir))),
    )  # fmt: skip
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_main, args=(job, child), name="libra-warm-start", daemon=True)
    proc.start()
    child.close()
    try:
        while True:
            if should_stop():
                _report(conn, ("stop",))
                proc.join(STOP_GRACE_S)
                raise KeyboardInterrupt
            if not conn.poll(0.1):
                continue
            try:
                kind, value = conn.recv()
            except EOFError:  # it died without a word (killed, or crashed in C code)
                proc.join(STOP_GRACE_S)
                raise TrainerError(
                    f"the warm start process ended without a result (exit code {proc.exitcode})"
                ) from None
            if kind == "progress" and on_progress is not None:
                on_progress(value)
            elif kind == "done":
                result: SFTResult = value
                return result
            elif kind == "stopped":  # interrupted from outside (a Ctrl-C reaches it too)
                raise KeyboardInterrupt
            elif kind == "error":
                raise value
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        conn.close()


def _main(job: _Job, conn: Connection) -> None:
    """The warm start process: train, report, exit."""
    _die_with_parent(job.parent)
    init_process(job.device)
    logging.basicConfig(
        level=os.environ.get("LIBRA_LOG", "WARNING"),
        format="[warm start] %(levelname)s %(message)s",
    )
    try:
        res = run_sft(
            job.model_dir, job.demos, job.out, steps=job.steps, batch=job.batch, lr=job.lr,
            target=job.target, seed=job.seed,
            on_progress=lambda p: conn.send(("progress", p)),
            should_stop=conn.poll,  # the caller sends only one message: stop
        )  # fmt: skip
        conn.send(("done", res))
    except KeyboardInterrupt:
        _report(conn, ("stopped", None))
    except BaseException as e:
        log.error("%s", traceback.format_exc())
        why = f"warm start: {type(e).__name__}: {e}"
        _report(conn, ("error", e if isinstance(e, LibraError) else TrainerError(why)))


def _report(conn: Connection, msg: tuple) -> None:
    """Send a last message if the other side still listens (either side may be ending)."""
    try:
        conn.send(msg)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the other side closed the pipe: nobody to tell


def _die_with_parent(parent: int) -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies, so a caller
    that is killed (SIGKILL, OOM) leaves no warm start training behind. The signal
    follows the thread that started the process, which `warm_start` keeps blocked
    until the process is gone."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the prctl took effect
        os._exit(1)


__all__ = [
    "SFTProgress",
    "SFTResult",
    "run_sft",
    "seq_prob",
    "sequence_logprobs",
    "warm_start",
]
