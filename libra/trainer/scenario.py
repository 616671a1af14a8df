"""A self-driven elastic member process, for `libra bench elastic` and the tests.

Core members step on synthetic GRPO batches until a stop update; a hybrid member runs
join -> train -> leave cycles. Every member writes one JSON line per update (timings,
membership, state hash when asked) to its log, which the caller reads afterwards.
No driver process is involved: the all-reduce paces everyone.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import time
from collections.abc import Callable
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
    """Synthetic samples per rank per update (when `global_samples` is 0)."""
    global_samples: int = 0
    """If > 0: one global batch per update, split over the ranks of the replicas that
    were current at the previous update (`ElasticWorker.ready_ids`), so the work per
    update does not change with membership."""
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
    start_after: int = 0
    """Hybrid: register for the first time once the core has done this many updates."""
    await_hybrids: int = 0
    """Core: after its first update, wait until this many hybrids have registered. A
    short run on a busy machine could otherwise end before a hybrid's process is up."""


def synthetic(
    update: int, member: str, rank: int, plan: MemberPlan, count: int = 0
) -> list:  # list[Sample]
    from libra.trainer.samples import Sample

    rng = random.Random(f"{update}/{member}/{rank}")
    out = []
    for _ in range(count or plan.samples):
        n = rng.randint(*plan.response_len)
        ids = [rng.randrange(plan.vocab) for _ in range(plan.prompt_len + n)]
        mask = [1 if rng.random() < 0.8 else 0 for _ in range(n)]
        mask[0] = 1
        lps = [-rng.uniform(0.5, 4.0) if m else 0.0 for m in mask]
        out.append(Sample(ids, plan.prompt_len, mask, lps, rng.gauss(0, 1), 0))
    return out


def batch(update: int, plan: MemberPlan, w) -> list:
    """This rank's samples for `update` (empty: contribute zeros)."""
    if not plan.global_samples:
        return synthetic(update, plan.id, plan.rank, plan) if w.state.ready else []
    ids = sorted(w.state.ready_ids)
    if not w.state.ready or plan.id not in ids:
        return []
    every = synthetic(update, "global", 0, plan, count=plan.global_samples)
    return every[ids.index(plan.id) * plan.size + plan.rank :: len(ids) * plan.size]


def main(plan: MemberPlan) -> None:
    import logging

    logging.basicConfig(
        level=os.environ.get("LIBRA_LOG", "WARNING"), format=f"[{plan.id}/{plan.rank}] %(message)s"
    )
    import torch.distributed as dist

    from libra.trainer.config import TrainerConfig
    from libra.trainer.device import Device, init_process, init_replica_group
    from libra.trainer.elastic import ElasticWorker
    from libra.trainer.rendezvous import connect
    from libra.trainer.replica import Replica

    cfg = TrainerConfig.model_validate_json(plan.config)
    device = Device.resolve(cfg)
    init_process(device)
    store = connect(cfg.elastic.host, plan.port, "libra")
    if plan.size > 1:
        base = connect(cfg.elastic.host, plan.port, f"replica/{plan.id}")
        init_replica_group(device, base, plan.rank, plan.size, cfg.elastic.timeout_s)
    replica = Replica(cfg, rank=plan.rank, size=plan.size, device=device)
    w = ElasticWorker(cfg, replica, member_id=plan.id, kind=plan.kind, store_port=plan.port)  # type: ignore[arg-type]
    try:
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
    finally:
        w.close()  # joins the worker's threads: exiting with them running can abort
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
        u = w.state.update + 1
        if store.check(["stop_at"]):
            stop = min(stop, int(bytes(store.get("stop_at"))))
        if u > stop:
            break
        while u == 2 and int(store.add("tickets", 0)) < plan.await_hybrids:
            time.sleep(0.01)  # registration needs `progress`, set by update 1
        _dump(plan, w, u, "params")
        res = w.step(batch(u, plan, w))
        _dump(plan, w, u, "grad")
        if w.state.coordinator:
            store.set("progress", str(res.update))
        record(res)


def _scramble(w) -> None:
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for t in w.replica.state_tensors():
            t.copy_(torch.randn(t.shape, generator=g))
    w.replica.set_counts(0, 7.0)


def _hybrid(plan: MemberPlan, w, store, record) -> None:
    last = plan.start_after - plan.idle_updates
    for cycle in range(plan.cycles):
        target = last + plan.idle_updates
        while not store.check(["progress"]) or int(bytes(store.get("progress"))) < target:
            time.sleep(0.01)
        if cycle:
            w.rejoin_reset()
        if plan.scramble and cycle:
            _scramble(w)
        t0 = time.perf_counter()
        w.register()
        w.wait_admission(w.ecfg.timeout_s + 60)
        trained = 0
        while True:
            u = w.state.update + 1
            if w.state.ready:
                _dump(plan, w, u, "params")
            res = w.step(batch(u, plan, w))
            _dump(plan, w, u, "grad")
            record(res, cycle=cycle, since_register_s=time.perf_counter() - t0)
            if res.left:
                break
            trained += res.contributed
            if trained >= plan.ready_updates and not w.state.leaving:
                w.leave()
        last = res.update
    if plan.rank == 0:
        store.set("stop_at", str(last + plan.stop_margin))


def run_scenario(
    plans: list[MemberPlan],
    *,
    timeout: float = 240,
    kill: tuple | None = None,
    after_kill: Callable[[], None] | None = None,
) -> dict[str, list[dict]]:
    """Spawn one process per plan, wait for all; returns each log's rows by `id-rank`.

    `kill=(key, predicate, signal)`: once `predicate(rows)` holds for the log `key`,
    send `signal` to that process (the test's crash / hang of a hybrid), then call
    `after_kill()` (e.g. to set the core's `stop_at`: a core that stops at a fixed
    update may finish before the signal lands, and then no drop is seen).
    """
    ctx = mp.get_context("spawn")
    procs = {f"{p.id}-{p.rank}": ctx.Process(target=main, args=(p,), daemon=True) for p in plans}
    for p in procs.values():
        p.start()
    logs = {f"{p.id}-{p.rank}": p.log for p in plans}
    deadline = time.monotonic() + timeout
    killed = None
    try:
        while any(p.is_alive() for k, p in procs.items() if k != killed):
            if time.monotonic() > deadline:
                raise TimeoutError("scenario did not finish")
            if kill and killed is None:
                key, pred, sig = kill
                if pred(read_log(logs[key])):
                    os.kill(procs[key].pid or 0, sig)
                    killed = key
                    if after_kill is not None:
                        after_kill()
            time.sleep(0.05)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join()
    for k, p in procs.items():
        if k != killed and p.exitcode != 0:
            raise RuntimeError(f"member {k} exited with {p.exitcode}")
    return {k: read_log(v) for k, v in logs.items()}


def read_log(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
