"""A client's task fields are untrusted input (issue 14, item 1): against a real
`libra serve-rollout` hosting every registered env (the default), tasks naming host
files through `swe-repair` are refused at submit with the field and the fix; nothing
is read, no episode runs, and the service keeps answering."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from libra.envs.loading import load_records
from libra.envs.swe_repair import SweRepair

from tests.integration.service_util import Service


async def post(base: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(base + "/v1/rollouts", json=body) as r:
        return r.status, orjson.loads(await r.read())


async def test_swe_repair_tasks_cannot_name_host_files(
    tmp_path: Path, tiny_model: Path, spawn_fake
) -> None:
    url, _ = spawn_fake()
    svc = Service(tmp_path, tiny_model, [url])  # no --env: every registered env is hosted
    base = svc.start()
    try:
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)  # reading it would block whoever reads until a writer comes
        secret = tmp_path / "secret.txt"
        secret.write_text("first line of a host file\n")
        good = load_records(SweRepair.default_tasks())[0]
        probes = [
            {"file": str(secret)},
            {"file": str(fifo)},
            {"file": "../" * 12 + str(secret).lstrip("/")},
            {"file": "toolz/../../../../../../etc/passwd", "line": 1},
            {"project": "../../../tmp"},
        ]
        for i, change in enumerate(probes):
            body = {"env": "swe-repair", "tasks": [{**good, **change}], "batch_id": f"p{i}"}
            status, doc = await post(base, body)
            assert status == 400, (change, doc)
            assert "tasks[0]: the env cannot build a prompt from it" in doc["error"]
            assert ("task['file']" in doc["error"]) != ("project" in change), doc
            assert "first line of a host file" not in doc["error"]
        async with aiohttp.ClientSession() as s:
            async with s.get(base + "/healthz") as r:
                assert r.status == 200
            async with s.get(base + "/metrics") as r:  # no episode ran at all
                text = await r.text()
        assert 'libra_episodes_finished_total{state="error"} 0' in text
        assert not (svc.spool / "p0").exists()
    finally:
        svc.close()
