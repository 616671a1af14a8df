"""A self-driven elastic member process, for `libra bench elastic` and the tests.

Core members step on synthetic GRPO batches until a stop update; a hybrid member runs
join -> train -> leave cycles. Every member writes one JSON line per update (timings,
membership, state hash when asked) to its log, which the caller reads afterwards.
No driver process is involved: the all-reduce paces everyone.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import time
from dataclasses import asdict, dataclass

import torch


@dataclass(slots=True)
class MemberPlan:
    id: str
    kind: str
    rank: int
    size: int
    core_ids: list[str]
    config: str
    """TrainerConfig as JSON."""
    port: int
    log: str
    samples: int = 2
    """Synthetic samples per rank per update."""
    prompt_len: int = 8
    response_len: tuple[int, int] = (4, 24)
    """Range of response lengths (unequal token counts across ranks)."""
    vocab: int = 256
    max_updates: int = 200
    """Core members stop here at the latest (if no hybrid sets an earlier stop)."""
    cycles: int = 1
    ready_updates: int = 3
    """Hybrid: updates with real gradients before leaving."""
    idle_updates: int = 3
    """Hybrid: core updates to wait between cycles."""
    stop_margin: int = 6
    """Hybrid: the core stops this many updates after the hybrid's last cycle."""
    hash_every: int = 1
    """Log the state hash every this many updates (0: never)."""
    dump_dir: str = ""
    """If set: save params before, and the averaged gradient of, every update."""
    scramble: bool = True
    """Hybrid: fill its state with garbage before every rejoin."""
    start_gate: str = ""
    """Hybrid: wait for this store key before the first registration."""


def synthetic(
    update: int, member: str, rank: int, plan: MemberPlan, version: int = 0
) -> list:  # list[Sample]
    from libra.trainer.samples import Sample

    rng = random.Random(f"{update}/{member}/{rank}")
    out = []
    for _ in range(plan.samples):
        n = rng.randint(*plan.response_len)
        ids = [rng.randrange(plan.vocab) for _ in range(plan.prompt_len + n)]
        mask = [1 if rng.random() < 0.8 else 0 for _ in range(n)]
        mask[0] = 1
        lps = [-rng.uniform(0.5, 4.0) if m else 0.0 for m in mask]
        out.append(Sample(ids, plan.prompt_len, mask, lps, rng.gauss(0, 1), version))
    return out


def main(plan: MemberPlan) -> None:
    import logging

    logging.basicConfig(
        level=os.environ.get("LIBRA_LOG", "WARNING"), format=f"[{plan.id}/{plan.rank}] %(message)s"
    )
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    from libra.trainer.config import TrainerConfig
    from libra.trainer.elastic import ElasticWorker
    from libra.trainer.groups import connect
    from libra.trainer.replica import Replica

    cfg = TrainerConfig.model_validate_json(plan.config)
    store = connect(cfg.elastic.host, plan.port, "libra")
    if plan.size > 1:
        base = connect(cfg.elastic.host, plan.port, f"replica/{plan.id}")
        dist.init_process_group(
            "gloo", store=base, rank=plan.rank, world_size=plan.size,
            timeout=datetime.timedelta(seconds=cfg.elastic.timeout_s),
        )  # fmt: skip
    replica = Replica(cfg, rank=plan.rank, size=plan.size)
    w = ElasticWorker(cfg, replica, member_id=plan.id, kind=plan.kind, store_port=plan.port)  # type: ignore[arg-type]
    with open(plan.log, "a") as log:

        def record(res, **extra) -> None:
            row = asdict(res)
            row.update(extra, rank=plan.rank, wall=time.time())
            if plan.hash_every and res.applied and res.update % plan.hash_every == 0:
                row["hash"] = replica.state_hash()
            log.write(json.dumps(row) + "\n")
            log.flush()

        if plan.kind == "core":
            _core(plan, w, store, record)
        else:
            _hybrid(plan, w, store, record)
    w.close()
    if plan.size > 1:
        dist.destroy_process_group()


def _dump(plan: MemberPlan, w, u: int, when: str) -> None:
    if not plan.dump_dir:
        return
    path = os.path.join(plan.dump_dir, f"{plan.id}-{plan.rank}-{u}-{when}.pt")
    if when == "params":
        torch.save([t.clone() for t in w.replica.state_tensors()], path)
    else:
        n = w.replica.grad_numel
        torch.save(w.bufs[u % 2][:n].clone(), path)


def _core(plan: MemberPlan, w, store, record) -> None:
    w.start_core(plan.core_ids)
    stop = plan.max_updates
    while True:
        u = w.update + 1
        if store.check(["stop_at"]):
            stop = min(stop, int(bytes(store.get("stop_at"))))
        if u > stop:
            break
        _dump(plan, w, u, "params")
        res = w.step(synthetic(u, plan.id, plan.rank, plan))
        _dump(plan, w, u, "grad")
        if w.coordinator:
            store.set("progress", str(res.update))
        record(res)


def _scramble(w) -> None:
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for t in w.replica.state_tensors():
            t.copy_(torch.randn(t.shape, generator=g))
    w.replica.set_updates(0)


def _hybrid(plan: MemberPlan, w, store, record) -> None:
    from libra.trainer.groups import wait_key

    if plan.start_gate:
        wait_key(store, plan.start_gate, 600)
    last = 0
    for cycle in range(plan.cycles):
        if cycle:
            target = last + plan.idle_updates
            while int(bytes(store.get("progress"))) < target:
                time.sleep(0.01)
            w.rejoin_reset()
        if plan.scramble and cycle:
            _scramble(w)
        t0 = time.perf_counter()
        w.register()
        w.wait_admission(w.ecfg.timeout_s + 60)
        trained = 0
        while True:
            u = w.update + 1
            _dump(plan, w, u, "params") if w.ready else None
            res = w.step(synthetic(u, plan.id, plan.rank, plan) if w.ready else ())
            _dump(plan, w, u, "grad")
            record(res, cycle=cycle, since_register_s=time.perf_counter() - t0)
            if res.left:
                break
            trained += res.contributed
            if trained >= plan.ready_updates and not w.leaving:
                w.leave()
        last = res.update
    if plan.rank == 0:
        store.set("stop_at", str(last + plan.stop_margin))
