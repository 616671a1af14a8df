"""Replica state carried whole, in one process: a donor streams its state over loopback
while a joiner buffers averaged gradients and then replays them (threads, no process
groups); checkpoints in one process (the sharded ones across replica sizes:
tests/integration/test_checkpoint_reshard.py). Both carry Adam's step count, which lags the update
count after updates nobody trained on."""

from __future__ import annotations

import time

import pytest
import torch

from libra.trainer.catchup import CatchUp
from libra.trainer.config import TrainerConfig
from libra.trainer.replica import Replica, sumsq
from libra.trainer.snapshot import Donor, Job, addr_of, listen
from tests.integration.test_elastic_helpers import micro_model


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> TrainerConfig:
    folder = micro_model(tmp_path_factory.mktemp("m") / "model")
    return TrainerConfig(model=str(folder), optim={"lr": 0.01})


def _grad(r: Replica, seed: int) -> torch.Tensor:
    return torch.randn(r.grad_numel, generator=torch.Generator().manual_seed(seed))


def _wait(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_joiner_replays_onto_the_snapshot_bit_identically(cfg):
    donor_r, joiner_r = Replica(cfg), Replica(cfg)
    with torch.no_grad():  # a joiner's state is garbage until the snapshot lands
        for t in joiner_r.state_tensors():
            t.normal_()
    joiner_r.set_counts(0, 5.0)
    donor_r.apply(_grad(donor_r, 0), 10, sumsq(_grad(donor_r, 0)))
    donor_r.apply(_grad(donor_r, 1), 0, 0.0)  # nobody trained: counts, but no Adam step
    assert (donor_r.updates, donor_r.adam_step) == (2, 1.0)

    listener = listen("127.0.0.1")
    catchup = CatchUp(joiner_r, listener, timeout_s=10, max_mb=64)
    donor = Donor(donor_r, rate_mb_s=None, timeout_s=10)
    try:
        catchup.expect("e1/j/0")
        donor.add([Job("e1/j/0", addr_of(listener))])
        donor.tick()  # snapshot of update 2, streamed in the background
        donor.wait_copied()
        for u in (3, 4, 5):  # the live replica trains on; the joiner buffers the same sums
            g = _grad(donor_r, u)
            donor_r.apply(g, 7 * u, sumsq(g))
            catchup.push(u, g.clone(), 7 * u, sumsq(g))
        _wait(catchup.drained)
        assert catchup.error is None and catchup.replayed == 3
        assert (joiner_r.updates, joiner_r.adam_step) == (5, 4.0)
        assert joiner_r.state_hash() == donor_r.state_hash()
        assert donor.sent and donor.sent[0][1]
    finally:
        donor.close()
        catchup.stop()
        listener.close()


def test_buffer_bound_is_memory_and_names_the_setting(cfg):
    r = Replica(cfg)
    listener = listen("127.0.0.1")
    per_update_mb = r.grad_numel * 4 / 1e6
    catchup = CatchUp(r, listener, timeout_s=10, max_mb=2.5 * per_update_mb)
    try:
        assert catchup.max_queue == 2
        catchup.expect("e1/j/0")  # no donor ever connects
        for u in (1, 2):
            catchup.push(u, _grad(r, u), 1, 1.0)
        assert catchup.error is None
        catchup.push(3, _grad(r, 3), 1, 1.0)
        assert catchup.error is not None and "elastic.max_catchup_mb" in catchup.error
        assert not catchup.drained()
        catchup.expect("e2/j/0")  # admitted again: a fresh start
        assert catchup.error is None
    finally:
        catchup.stop()
        listener.close()
    # A limit below one gradient still buffers one update (and then names the limit).
    listener = listen("127.0.0.1")
    tiny = CatchUp(r, listener, timeout_s=1, max_mb=1e-6)
    tiny.stop()
    listener.close()
    assert tiny.max_queue == 1


def _trained(cfg: TrainerConfig) -> Replica:
    r = Replica(cfg)
    r.apply(_grad(r, 0), 10, sumsq(_grad(r, 0)))
    r.apply(_grad(r, 1), 0, 0.0)
    r.apply(_grad(r, 2), 5, sumsq(_grad(r, 2)))
    return r


def test_checkpoint_round_trip_keeps_adam_step(cfg, tmp_path):
    from libra.trainer.checkpoint import export_model, load, read_meta, save
    from libra.trainer.model import load_model

    r = _trained(cfg)
    folder = save(r, tmp_path / "ckpt", {"version": 3})
    assert folder is not None and not list(folder.glob("*.safetensors"))  # shards only
    assert read_meta(folder) == {"version": 3, "updates": 3, "adam_step": 2.0}
    back = Replica(cfg)
    load(back, folder)
    assert (back.updates, back.adam_step) == (3, 2.0)
    assert back.state_hash() == r.state_hash()
    # saving again replaces the folder; an HF folder is made from it on demand
    r.apply(_grad(r, 3), 5, sumsq(_grad(r, 3)))
    save(r, folder, {"version": 4})
    model = load_model(export_model(folder, tmp_path / "hf", cfg.model))
    assert all(torch.equal(a, b) for a, b in
               zip(model.parameters(), r.model.parameters(), strict=True))  # fmt: skip


def test_a_checkpoint_of_the_earlier_layout_still_loads(cfg, tmp_path):
    import json

    from libra.trainer.checkpoint import full_state, load
    from libra.trainer.model import tied_keys, write_folder

    r = _trained(cfg)
    folder = write_folder(full_state(r), cfg.model, tmp_path / "old", tied_keys(r.model))
    st = r.optimizer.state
    opt: dict = {n: {k: st[p][k].clone() for k in ("exp_avg", "exp_avg_sq")}
                 for n, p in r.model.named_parameters()}  # fmt: skip
    torch.save({**opt, "__adam_step__": r.adam_step}, folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"version": 3, "updates": 3}))
    back = Replica(cfg)
    load(back, folder)
    assert back.state_hash() == r.state_hash()


def test_a_folder_that_is_not_a_checkpoint_says_so(cfg, tmp_path):
    from libra.errors import ConfigError
    from libra.trainer.checkpoint import check

    with pytest.raises(ConfigError, match="not a trainer checkpoint"):
        check(cfg.model)
    (tmp_path / "trainer_state.json").write_text('{"version": 1, "updates": 1}')
    with pytest.raises(ConfigError, match="no shards"):
        check(tmp_path)


def test_a_gpu_shard_lands_through_host_memory_on_the_catch_up_thread():
    """On CUDA a joiner's state tensors receive through a host buffer then copy in,
    on the catch-up thread, where grad mode is on: the copy into a parameter (a leaf
    that requires grad) must not go through autograd (seen on an H200: the hybrid's
    snapshot failed with "a leaf Variable that requires grad is being used in an
    in-place operation"). `via_host` takes that path with a CPU parameter."""
    import socket
    import threading

    from libra.trainer.catchup import _recv_tensor
    from libra.trainer.snapshot import _view

    param = torch.nn.Parameter(torch.zeros(64, 8))
    sent = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            _recv_tensor(b, param, via_host=True)
        except BaseException as e:  # the test reports it below
            errors.append(e)

    a, b = socket.socketpair()
    with a, b:
        t = threading.Thread(target=receive)
        t.start()
        a.sendall(_view(sent))
        t.join(30)
    assert not errors, errors
    assert torch.equal(param.detach(), sent) and param.requires_grad
