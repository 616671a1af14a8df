"""Where the trainer computes (`trainer.device`), decided in one place, and which GPU
each rank takes. This machine has no GPU: the CUDA ranks themselves run in
`scripts/gpu-check.sh` (docs/elastic.md, "On GPUs", says what only a GPU node proves);
here, what a user sees before any rank starts and how GPUs are dealt."""

from __future__ import annotations

import pytest
import torch

from libra.errors import ConfigError, TrainerError
from libra.trainer import ElasticTrainer, TrainerConfig
from libra.trainer.device import CPU, Device, cuda, resolve_type
from libra.trainer.ranks import GpuPool


def test_auto_follows_the_machine_and_cuda_without_a_gpu_names_the_fix() -> None:
    assert resolve_type("auto", cuda_here=False) == "cpu"
    assert resolve_type("auto", cuda_here=True) == "cuda"
    assert resolve_type("cpu", cuda_here=True) == "cpu"
    assert resolve_type("cuda", cuda_here=True) == "cuda"
    with pytest.raises(ConfigError, match=r"trainer\.device = 'cuda': no CUDA GPU .* 'cpu'"):
        resolve_type("cuda", cuda_here=False)
    assert not torch.cuda.is_available()  # this machine: auto trains on the CPU
    assert Device.resolve(TrainerConfig(model="m")) == CPU
    assert Device.resolve(TrainerConfig(model="m", device="cpu"), gpu=3) == CPU


def test_a_cuda_rank_takes_its_gpu_and_nccl_collectives_take_device_tensors() -> None:
    d = cuda(5)
    assert (d.backend, d.torch, d.comm) == ("nccl", torch.device("cuda", 5), d.torch)
    assert CPU.comm == torch.device("cpu")  # gloo here takes host tensors


def test_a_cuda_trainer_on_a_machine_without_gpus_stops_before_any_rank_starts() -> None:
    trainer = ElasticTrainer(TrainerConfig(model="/nowhere", device="cuda"))
    try:
        with pytest.raises(ConfigError, match=r"trainer\.device = 'cuda'"):
            trainer.start()
        assert trainer.replicas() == []  # nothing was spawned
    finally:
        trainer.close()


def test_gpus_are_dealt_one_per_rank_and_come_back_when_a_replica_is_gone() -> None:
    pool = GpuPool([4, 5, 6, 7])
    assert pool.take("core0", 2) == [4, 5]
    assert pool.take("h0", 1, want=[7]) == [7]  # a hybrid gets the GPUs its engine left
    assert pool.take("h1", 1) == [6]
    with pytest.raises(TrainerError, match=r"replica h2 needs 1 GPU\(s\), 0 free"):
        pool.take("h2", 1)
    with pytest.raises(TrainerError, match=r"replica h2 was handed GPUs \[5\]: .* free"):
        pool.take("h2", 1, want=[5])  # core0 holds it
    with pytest.raises(TrainerError, match=r"handed GPUs \[1\]: .* trainer\.gpus"):
        pool.take("h2", 1, want=[1])  # not the trainer's
    pool.release("h0")
    assert pool.take("h2", 1) == [7]


def test_a_gpu_listed_twice_is_refused() -> None:
    for gpus in ([0, 0], [-1]):
        with pytest.raises(ValueError, match=r"gpus: .* twice or a negative"):
            TrainerConfig(model="m", gpus=gpus)
