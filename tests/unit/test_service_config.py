"""Service config and request bodies: the example config loads, a submit's sampling
overrides only what it names, idempotency ignores defaults spelled out, exposure rule."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from libra import config as cfgmod
from libra.endpoints.config import SamplingConfig
from libra.errors import ConfigError
from libra.service.batch import request_digest, submit_digest
from libra.service.config import ServiceConfig, SubmitRequest
from libra.service.server import check_exposure
from tests.conftest import ROOT


def test_example_config_loads() -> None:
    cfg = cfgmod.load(ServiceConfig, ROOT / "examples/serve-rollout.toml")
    assert [e.key for e in cfg.envs] == ["arith", "say-a"]
    assert cfg.spool.fsync == "always" and cfg.buckets[0].launch == 1
    assert cfg.sampling.max_tokens == 48


def test_unknown_keys_fail_with_their_path() -> None:
    with pytest.raises(ConfigError, match=r"spool\.fsnyc: unknown key"):
        cfgmod.build(ServiceConfig, {"spool": {"fsnyc": "always"}})


def test_submit_sampling_overrides_only_the_keys_it_names() -> None:
    base = SamplingConfig(temperature=0.7, max_tokens=48, seed=3)
    req = SubmitRequest(env="arith", tasks=[{"id": "a"}], sampling={"max_tokens": 8})
    eff = req.sampling_over(base)
    assert (eff.temperature, eff.max_tokens, eff.seed) == (0.7, 8, 3)


def test_idempotency_digest_ignores_spelled_out_defaults() -> None:
    a = SubmitRequest(env="arith", tasks=[{"id": "a"}])
    b = SubmitRequest(env="arith", tasks=[{"id": "a"}], group_size=1, sampling={"top_p": 1.0})
    c = SubmitRequest(env="arith", tasks=[{"id": "a"}], group_size=2)
    digest = [request_digest(r.model_dump(mode="json")) for r in (a, b, c)]
    assert digest[0] == digest[1] != digest[2]


def test_a_batch_s_weight_is_part_of_its_request_and_must_be_positive() -> None:
    one = SubmitRequest(env="arith", tasks=[{"id": "a"}])
    same = SubmitRequest(env="arith", tasks=[{"id": "a"}], weight=1.0)
    three = SubmitRequest(env="arith", tasks=[{"id": "a"}], weight=3.0)
    digest = [submit_digest(r, SamplingConfig()) for r in (one, same, three)]
    assert digest[0] == digest[1] != digest[2]  # a resubmit with another weight is another request
    # the default leaves the digest of a request stored before weights existed unchanged
    assert digest[0] == request_digest({k: v for k, v in one.model_dump(mode="json").items()
                                        if k != "weight"})  # fmt: skip
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValidationError, match="weight"):
            SubmitRequest(env="arith", tasks=[{"id": "a"}], weight=bad)


@pytest.mark.parametrize(
    ("host", "token", "ok"),
    [("127.0.0.1", None, True), ("::1", None, True), ("localhost", None, True),
     ("0.0.0.0", None, False), ("10.1.2.3", None, False), ("0.0.0.0", "t", True)],
)  # fmt: skip
def test_only_loopback_without_a_token(host: str, token: str | None, ok: bool) -> None:
    cfg = ServiceConfig(host=host, token=token)
    if ok:
        check_exposure(cfg)
    else:
        with pytest.raises(ConfigError, match="without a token"):
            check_exposure(cfg)
