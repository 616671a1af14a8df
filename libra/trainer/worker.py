"""The trainer process: one rank of one replica, driven by `ElasticTrainer` over a pipe.

Commands (tuples) and replies:

    ("register",)         -> ("ok", ticket)   hybrids: ask to join (admitted later)
    ("version", v, [samples per mini-batch])  -> ("ok", None)     this rank's share
    ("update", u, m)      -> ("step", StepResult) | ("skip", None)  mini-batch m as update u
    ("leave",)            -> ("ok", None)     leave at the next update (or withdraw)
    ("save", dir, meta, checkpoint: bool) -> ("ok", path | None)   every rank of the
                                              replica: a sharded checkpoint, or an HF folder
    ("hash",)             -> ("ok", state hash of this rank)
    ("wt", op, ...)       -> ("ok", value)    core0 only: weight broadcast
                                              (`libra.trainer.broadcast`)
    ("stop",)             -> ("ok", None), then exit

On start the process sends ("ready", info) once its replica is built. A hybrid asks to
join only when the driver says so, at a step boundary: from then on it gets every
update command, so it is never admitted to an epoch it would not step in. While idle it
watches the store for a recovery opened by other ranks, so a rank that already finished
an update can join it.
Errors go back as ("error", message); the process then exits.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

log = logging.getLogger("libra.trainer")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    config: str
    """TrainerConfig as JSON."""
    member_id: str
    kind: str
    rank: int
    size: int
    core_ids: list[str]
    port: int
    resume: str | None = None
    store_host: str = ""
    """Where the run's rendezvous store listens (empty: `elastic.host`, one machine)."""
    host: str = ""
    """The address this rank binds its sockets to (empty: `elastic.host`); a rank on
    another node gets its node's address."""
    gpu: int | None = None
    """On CUDA, the GPU ordinal this rank computes on (None: the first visible one: a
    rank in a Ray actor sees only the GPU Ray gave it)."""


def brief(e: BaseException) -> str:
    """`e` in one line for the driver's error: its first line and, when its text runs
    over several (torch's checkpoint errors carry each rank's traceback), its last, which
    names the cause. The rank logs the whole of it."""
    lines = [ln.strip() for ln in f"{type(e).__name__}: {e}".splitlines() if ln.strip()]
    if len(lines) <= 2:
        return " ".join(lines)
    return f"{lines[0]} ... {lines[-1]} (the rank logged the whole traceback)"


def main(spec: WorkerSpec, conn: Connection) -> None:
    _name(f"libra-{spec.member_id}-{spec.rank}")
    logging.basicConfig(
        level=os.environ.get("LIBRA_LOG", "WARNING"),
        format=f"[{spec.member_id}/{spec.rank}] %(levelname)s %(message)s",
    )
    opened: list[Any] = []
    try:
        _serve(spec, conn, opened)
    except (EOFError, KeyboardInterrupt):
        pass  # the driver went away
    except BaseException as e:
        log.error("%s: %s\n%s", type(e).__name__, e, traceback.format_exc())
        try:
            conn.send(("error", brief(e)))
        except OSError:
            pass  # the driver is gone: nobody to tell (the error is logged above)
    finally:
        # Also after an error (once it is reported): a worker thread left inside torch
        # when the interpreter shuts down aborts the process (libra.trainer.rendezvous).
        for w in opened:
            w.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _name(name: str) -> None:
    """Linux: the process's name as `ps`, `top` and `/proc/PID/comm` show it (15 bytes:
    `libra-core0-0`, `libra-hybrid1-0`), so a rank can be told from the others."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def _serve(spec: WorkerSpec, conn: Connection, opened: list[Any]) -> None:
    from libra.trainer import checkpoint, grpo
    from libra.trainer.config import TrainerConfig
    from libra.trainer.device import Device, init_process, init_replica_group
    from libra.trainer.elastic import ElasticWorker
    from libra.trainer.recovery import pending, recover
    from libra.trainer.rendezvous import connect
    from libra.trainer.replica import Replica

    cfg = TrainerConfig.model_validate_json(spec.config)
    device = Device.resolve(cfg, spec.gpu)
    init_process(device)
    if spec.size > 1:
        store = connect(spec.store_host or cfg.elastic.host, spec.port, f"replica/{spec.member_id}")
        init_replica_group(device, store, spec.rank, spec.size, cfg.elastic.timeout_s)
    replica = Replica(cfg, rank=spec.rank, size=spec.size, device=device)
    if spec.resume:  # the architecture from cfg.model, the state from the checkpoint
        checkpoint.load(replica, spec.resume)
    w = ElasticWorker(cfg, replica, member_id=spec.member_id, kind=spec.kind,  # type: ignore[arg-type]
                      store_port=spec.port, store_host=spec.store_host or None,
                      host=spec.host or None)  # fmt: skip
    opened.append(w)
    st = w.state  # read here; changed only by the worker's own methods
    if spec.kind == "core":
        w.start_core(spec.core_ids)
    conn.send(("ready", {"updates": replica.updates}))
    shares: list[list[Any]] = []
    old: list[list[torch.Tensor] | None] = []
    sends: Any = None
    while True:
        if not conn.poll(0.05):
            if st.epoch is not None and not st.left and pending(w):
                recover(w, st.update + 1)
            continue
        cmd = conn.recv()
        op = cmd[0]
        if op == "version":
            shares, old = cmd[2], [None] * len(cmd[2])
            if cfg.grpo.minibatches > 1 and st.ready:  # the ratio's `old`: before any update
                old = [grpo.old_logprobs(replica.model, s, cfg.grpo, dtype=cfg.dtype,
                                         device=device, count=_count(w, s))
                       for s in shares]  # fmt: skip
            conn.send(("ok", None))
        elif op == "update":
            u, m = cmd[1], cmd[2]
            if st.left or (st.epoch is None and not (w.poll_admission() and w.member_at(u))):
                conn.send(("skip", None))
                continue
            mine = shares[m] if st.ready and m < len(shares) else []
            res = w.step(mine, old[m] if st.ready and m < len(old) else None)
            conn.send(("step", res))
            if res.left:
                break
        elif op == "register":  # sent by the driver once it counts this rank as live
            conn.send(("ok", w.register()))
        elif op == "leave":
            if st.epoch is None and st.pending is None and w.cancel():
                conn.send(("ok", "withdrawn"))
                break
            w.leave()
            conn.send(("ok", None))
        elif op == "save":
            path = checkpoint.save(replica, cmd[1], cmd[2]) if cmd[3] else \
                checkpoint.save_model(replica, cmd[1], cfg.model)  # fmt: skip
            conn.send(("ok", str(path) if path else None))
        elif op == "hash":
            conn.send(("ok", replica.state_hash()))
        elif op == "wt":
            if sends is None:
                from libra.trainer.broadcast import Broadcasts

                sends = Broadcasts(replica)
            conn.send(("ok", sends.handle(cmd)))
        elif op == "stop":
            conn.send(("ok", None))
            break


def _count(w: Any, samples: list[Any]) -> int | None:
    """FSDP ranks of one replica agree on the number of forward passes."""
    if w.size == 1:
        return None
    from libra.trainer.grpo import passes

    return int(w.replica.intra_max(passes(samples, w.cfg.grpo)))


__all__ = ["WorkerSpec", "main"]
