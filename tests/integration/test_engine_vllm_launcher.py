"""`libra.cluster.vllm`: the launcher's process handling against a stand-in `vllm` module
(the real server runs in the CI vLLM stage). The stand-in is a real HTTP server that
also forks a child, like vLLM's engine-core process, so `stop` must reap the group."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest

from libra.cluster import vllm
from libra.errors import ConfigError, EndpointDown
from tests.conftest import free_port

STANDIN = """
import http.server, os, subprocess, sys, time
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
marker = os.environ["STANDIN_DIR"]
attempt_file = os.path.join(marker, f"attempts-{port}")
n = int(open(attempt_file).read()) + 1 if os.path.exists(attempt_file) else 1
open(attempt_file, "w").write(str(n))
open(os.path.join(marker, f"args-{port}"), "w").write(" ".join(args))
open(os.path.join(marker, f"env-{port}"), "w").write(
    os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "") + "," + os.environ.get("VLLM_SERVER_DEV_MODE", ""))
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(os.path.join(marker, f"child-{port}"), "w").write(str(child.pid))
if n <= int(os.environ.get("STANDIN_FAIL_FIRST", "0")):
    sys.exit(3)  # a failed start
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@pytest.fixture
def standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pkg = tmp_path / "site" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(textwrap.dedent(STANDIN))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("STANDIN_DIR", str(tmp_path))
    return tmp_path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[1].split()[0] != "Z"


def launch(tmp: Path, ports: list[int], **kw) -> vllm.VllmLaunch:
    servers = [vllm.VllmServer(tp=1 + i, port=p) for i, p in enumerate(ports)]
    return vllm.VllmLaunch(
        model=str(tmp), servers=servers, device="cpu", log_dir=str(tmp / "logs"), **kw
    )


def test_start_waits_for_health_and_stop_reaps_the_process_group(standin: Path):
    ports = [free_port(), free_port()]
    procs = vllm.start(launch(standin, ports, startup_timeout_s=60, dtype="float32"))
    try:
        assert all(vllm.healthy(p.url) for p in procs)
        args = (standin / f"args-{ports[1]}").read_text()
        assert "--tensor-parallel-size 2" in args and "--dtype float32" in args
        assert "--enable-auto-tool-choice --tool-call-parser hermes" in args
        assert (standin / f"env-{ports[1]}").read_text() == "0|1,1"
        children = [int((standin / f"child-{p}").read_text()) for p in ports]
        assert all(_alive(c) for c in children)
    finally:
        vllm.stop(procs)
    assert not any(vllm.healthy(p.url) for p in procs)
    deadline = time.monotonic() + 10
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(c) for c in children)


def test_a_failed_start_is_retried_once(standin: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("STANDIN_FAIL_FIRST", "1")
    port = free_port()
    procs = vllm.start(launch(standin, [port], startup_timeout_s=60, start_retries=1))
    try:
        assert (standin / f"attempts-{port}").read_text() == "2"
        assert vllm.healthy(procs[0].url)
    finally:
        vllm.stop(procs)


def test_a_server_that_never_comes_up_is_one_clear_error(
    standin: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("STANDIN_FAIL_FIRST", "5")
    port = free_port()
    with pytest.raises(EndpointDown, match=f"port {port}.*2 attempt"):
        vllm.start(launch(standin, [port], startup_timeout_s=30, start_retries=1))


def test_gpu_ids_must_match_tp():
    cfg = vllm.VllmLaunch(model="/m", servers=[vllm.VllmServer(tp=2, port=8000, gpus=[0])])
    with pytest.raises(ConfigError, match="tp=2 needs 2 gpus"):
        vllm.environment(cfg, cfg.servers[0])
    ok = vllm.VllmServer(tp=2, port=8001, gpus=[2, 3])
    assert vllm.environment(cfg, ok)["CUDA_VISIBLE_DEVICES"] == "2,3"
